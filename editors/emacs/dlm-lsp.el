;;; dlm-lsp.el --- dlm-lsp for lsp-mode and eglot -*- lexical-binding: t -*-
;; A small config, not a package: load it, then call one of the setup functions.
;;
;;   (load "/path/to/dlm-lsp/editors/emacs/dlm-lsp.el")
;;   (setq dlm-lsp-command '("/path/to/.venv/bin/dlm-lsp" "serve"))  ; default: dlm-lsp on PATH
;;   (dlm-lsp-mode-setup)   ; lsp-mode: an add-on client beside the language's own server
;;   ;; or
;;   (dlm-eglot-setup)      ; eglot: the server for these modes (eglot runs one per mode)
;;
;; Both handle the server's `dlm/status' notification (engine state and last fill latency:
;; docs/lsp-extensions.md), so lsp-mode logs no "Unknown notification" warning for it. The latest
;; status is in `dlm-lsp-status'; `dlm-lsp-status-functions' runs on each one (for a mode line).
;; Fills come through `textDocument/completion' (completion-at-point, company): lsp-mode 8.0 and
;; eglot 1.9 have no inline completion.

(require 'cl-lib)

(require 'json)

(defvar dlm-lsp-command '("dlm-lsp" "serve")
  "The server command: the executable and its arguments.")

(defvar dlm-lsp-initialization-options '(:budgetMs 300 :device "auto")
  "initializationOptions sent to the server, a plist (see docs/lsp-extensions.md).")

(defvar dlm-lsp-modes '(python-mode python-ts-mode js-mode js-ts-mode typescript-mode typescript-ts-mode
                        go-mode go-ts-mode rust-mode rust-ts-mode)
  "Major modes that get dlm-lsp.")

(defvar dlm-lsp-status nil
  "The server's last dlm/status params, a plist: :state :model :device :lastLatencyMs :message.")

(defvar dlm-lsp-status-functions nil
  "Functions called with the new `dlm-lsp-status' plist whenever the server sends one.")

(defun dlm-lsp--status (plist)
  "Records a dlm/status PLIST; an error is shown once, since completions stop until it is fixed."
  (let ((was (plist-get dlm-lsp-status :state)))
    (setq dlm-lsp-status plist)
    (when (and (equal (plist-get plist :state) "error") (not (equal was "error")))
      (message "dlm-lsp: %s" (or (plist-get plist :message) "the model failed to load")))
    (run-hook-with-args 'dlm-lsp-status-functions plist)))

(defun dlm-lsp-status-string ()
  "Gives a short status for a mode line: \"DLM 182ms\", \"DLM loading\", \"DLM error\" or \"\"."
  (let ((state (plist-get dlm-lsp-status :state))
        (ms (plist-get dlm-lsp-status :lastLatencyMs)))
    (cond ((null state) "")
          ((and (equal state "ready") (numberp ms)) (format "DLM %dms" (round ms)))
          (t (format "DLM %s" state)))))

(defun dlm-lsp--prestart-json ()
  "The options that pick the engine, as the JSON object DLM_LSP_PRESTART carries, or nil when
`:engine' names an HTTP endpoint (nothing slow to start)."
  (let ((o dlm-lsp-initialization-options) (hint nil))
    (unless (let ((e (plist-get o :engine))) (and e (not (stringp e))))
      (dolist (k '(:model :device :engine :threads))
        (when (plist-member o k)
          (setq hint (plist-put hint k (plist-get o k)))))
      (let ((json-null :null)) (json-encode (or hint (make-hash-table)))))))

(defun dlm-lsp-server-command ()
  "The server command, told through `env' which engine the options pick (DLM_LSP_PRESTART, see
docs/lsp-extensions.md), so the server starts it before the initialize handshake."
  (let ((json (dlm-lsp--prestart-json)))
    (if (and json (executable-find "env"))
        `("env" ,(concat "DLM_LSP_PRESTART=" json) ,@dlm-lsp-command)
      dlm-lsp-command)))

;;; lsp-mode

(defun dlm-lsp-mode-setup ()
  "Registers dlm-lsp as an lsp-mode add-on client for `dlm-lsp-modes'."
  (require 'lsp-mode)
  (lsp-register-client
   (make-lsp-client
    :new-connection (lsp-stdio-connection #'dlm-lsp-server-command)
    :major-modes dlm-lsp-modes
    :server-id 'dlm-lsp
    :add-on? t                          ; beside pyright, gopls, ...
    :priority -2
    :initialization-options (lambda () dlm-lsp-initialization-options)
    :notification-handlers
    (let ((handlers (make-hash-table :test 'equal)))
      ;; lsp-mode gives params as a hash table (or a plist with lsp-use-plists)
      (puthash "dlm/status"
               (lambda (_workspace params)
                 (dlm-lsp--status
                  (if (hash-table-p params)
                      (let (plist)
                        (maphash (lambda (k v) (setq plist (plist-put plist (intern (concat ":" k)) v))) params)
                        plist)
                    params)))
               handlers)
      handlers))))

;;; eglot

(defun dlm-eglot-setup ()
  "Makes dlm-lsp eglot's server for `dlm-lsp-modes'."
  (require 'eglot)
  (add-to-list 'eglot-server-programs
               `(,dlm-lsp-modes . (,@(dlm-lsp-server-command) :initializationOptions ,dlm-lsp-initialization-options))))

(with-eval-after-load 'eglot
  (cl-defmethod eglot-handle-notification (_server (_method (eql dlm/status)) &rest params)
    "Records the server's engine status (docs/lsp-extensions.md)."
    (dlm-lsp--status params)))

(provide 'dlm-lsp)
;;; dlm-lsp.el ends here
