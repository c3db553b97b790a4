;;; dlm-test.el --- Emacs clients against the real dlm-lsp server, in batch mode -*- lexical-binding: t -*-
;; Run (editors/run-tests.sh does):
;;   DLM_TEST_CLIENT=lsp-mode|eglot DLM_LSP_CMD='dlm-lsp serve' emacs --batch -l editors/emacs/dlm-test.el
;; DLM_LSP_MODEL sets the `model' option. The options send `postprocess: false' (the server's test
;; hook, so the tiny test model's fill is not filtered to nothing). Loads dlm-lsp.el, the config
;; docs/editors.md documents, and prints TAP lines ("ok - ..." / "not ok - ...") on stdout.
;; Checks: the client connects; dlm/status reaches `dlm-lsp-status' with no unknown-notification
;; warning; completion-at-point in an empty loop body offers the fill, and choosing it inserts
;; exactly the item's textEdit, the rest of the buffer untouched.

(require 'cl-lib)
(require 'subr-x)
(defvar dlm-test-client (or (getenv "DLM_TEST_CLIENT") "eglot"))
(defvar dlm-test-failures 0)
(defvar dlm-test-text "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n")

(defun dlm-test-out (fmt &rest args)
  (princ (concat (apply #'format fmt args) "\n")))

(defun dlm-test (name ok &optional detail)
  "Prints a TAP line for NAME: ok when OK is non-nil; DETAIL explains a failure."
  (if ok
      (dlm-test-out "ok - emacs %s: %s" dlm-test-client name)
    (setq dlm-test-failures (1+ dlm-test-failures))
    (dlm-test-out "not ok - emacs %s: %s%s" dlm-test-client name (if detail (format " (%s)" detail) ""))))

(defun dlm-test-wait (pred seconds)
  "Runs the event loop until PRED gives non-nil or SECONDS pass; gives PRED's value."
  (let ((end (+ (float-time) seconds)) value)
    (while (and (not (setq value (funcall pred))) (< (float-time) end))
      (accept-process-output nil 0.1))
    value))

(defun dlm-test-version (pkg)
  "PKG's version, from the Version: header of its source file."
  (require 'lisp-mnt)
  (let ((source (locate-library (format "%s.el" pkg) t)))
    (or (and source (lm-version source)) "?")))

(defun dlm-test-get (obj key)
  "KEY (a string) of a JSON object OBJ, a hash table (lsp-mode) or a plist (eglot)."
  (if (hash-table-p obj) (gethash key obj) (plist-get obj (intern (concat ":" key)))))

(defun dlm-test-apply (text edit)
  "TEXT with the LSP TextEdit EDIT applied (positions: line and UTF-16 column; ASCII here)."
  (with-temp-buffer
    (insert text)
    (cl-flet ((pos (p) (goto-char (point-min))
                   (forward-line (dlm-test-get p "line"))
                   (+ (point) (dlm-test-get p "character"))))
      (let* ((range (dlm-test-get edit "range"))
             (beg (pos (dlm-test-get range "start")))
             (end (pos (dlm-test-get range "end"))))
        (delete-region beg end)
        (goto-char beg)
        (insert (dlm-test-get edit "newText"))
        (buffer-string)))))

(load (expand-file-name "dlm-lsp.el" (file-name-directory load-file-name)))
(setq dlm-lsp-command (split-string (or (getenv "DLM_LSP_CMD") "dlm-lsp serve"))
      dlm-lsp-initialization-options
      `(:budgetMs 2000 :device "cpu" :postprocess :json-false
        ,@(and (getenv "DLM_LSP_MODEL") (list :model (getenv "DLM_LSP_MODEL")))))
(require 'python)

;; The server is told at start which engine the options pick (DLM_LSP_PRESTART)
(let* ((cmd (dlm-lsp-server-command))
       (var (seq-find (lambda (w) (string-prefix-p "DLM_LSP_PRESTART=" w)) cmd))
       (hint (and var (let ((json-object-type 'plist)) (json-read-from-string (substring var 17))))))
  (dlm-test "the server is told the engine at start" (and hint (equal (plist-get hint :device) "cpu")
                                                          (equal (last cmd 2) (last dlm-lsp-command 2)))
            (format "command %S" cmd)))

(let* ((dir (make-temp-file "dlm-emacs-" t))
       (file (expand-file-name "example.py" dir))
       (user-emacs-directory (file-name-as-directory (expand-file-name "emacs.d" dir))))
  (with-temp-file file (insert dlm-test-text))
  (find-file file)
  (python-mode)
  (goto-char (point-min))
  (forward-line 6)
  (end-of-line)                         ; the empty loop body: a block hole
  (let ((start (float-time)) capf-fn connected)
    (pcase dlm-test-client
      ("lsp-mode"
       (require 'lsp-mode)
       (dlm-test-out "# lsp-mode %s (inline completion: %s)" (dlm-test-version 'lsp-mode)
                     (if (locate-library "lsp-inline-completion") "yes" "no: lsp-inline-completion.el came after 9.0.0, in Nov 2024"))
       (setq lsp-session-file (expand-file-name "lsp-session" dir)
             lsp-enabled-clients '(dlm-lsp)   ; no other Python server is tried (none is installed)
             lsp-auto-guess-root nil
             lsp-restart 'ignore
             lsp-enable-file-watchers nil
             lsp-headerline-breadcrumb-enable nil
             lsp-modeline-code-actions-enable nil
             lsp-modeline-diagnostics-enable nil
             lsp-modeline-workspace-status-enable nil
             lsp-response-timeout 60)
       (dlm-lsp-mode-setup)
       ;; lsp-mode asks where the project root is; the folder is known in advance here
       (lsp-workspace-folders-add dir)
       (lsp)
       (setq connected (dlm-test-wait (lambda () (and (bound-and-true-p lsp-mode) (lsp-workspaces)
                                                      (eq (lsp--workspace-status (car (lsp-workspaces))) 'initialized)))
                                      120))
       (setq capf-fn #'lsp-completion-at-point))
      (_
       (require 'eglot)
       (dlm-test-out "# eglot %s, Emacs %s" (dlm-test-version 'eglot) emacs-version)
       (setq eglot-sync-connect 120 eglot-connect-timeout 180)
       ;; makes eglot warn about a notification nobody handles: the check below must see none
       (setq eglot-strict-mode (cons 'disallow-unknown-methods (bound-and-true-p eglot-strict-mode)))
       (dlm-eglot-setup)
       ;; eglot-ensure waits for a command loop that batch mode never runs; start it directly, in a
       ;; throwaway project rooted at the file's folder
       (let ((project-find-functions (list (lambda (d) (cons 'transient d)))))
         (apply #'eglot (eglot--guess-contact)))
       (setq connected (eglot-current-server))
       (setq capf-fn #'eglot-completion-at-point)))
    (dlm-test "connects to the server" connected)
    (when connected
      (dlm-test-out "# connected in %.1f s" (- (float-time) start))
      (let ((ready (dlm-test-wait (lambda () (equal (plist-get dlm-lsp-status :state) "ready")) 120)))
        (dlm-test "dlm/status handled (engine ready)" ready (format "last status %S" dlm-lsp-status)))
      ;; The first requests may come before the model is loaded (answered empty); ask again.
      (let* ((orig (buffer-string)) capf cands)
        (dlm-test-wait (lambda ()
                         (setq capf (funcall capf-fn)
                               cands (and capf (all-completions "" (nth 2 capf))))
                         (or cands (progn (sleep-for 0.5) nil)))
                       60)
        (dlm-test "completion-at-point offers the fill" cands "no candidates")
        (when cands
          (let* ((cand (car cands))
                 (item (get-text-property 0 (if (equal dlm-test-client "lsp-mode") 'lsp-completion-item 'eglot--lsp-item) cand))
                 (edit (and item (dlm-test-get item "textEdit")))
                 (exit (plist-get (nthcdr 3 capf) :exit-function)))
            (dlm-test-out "# candidates: %S" (mapcar #'substring-no-properties cands))
            ;; choose it the way completion-at-point does: insert the candidate, then :exit-function
            (insert cand)
            (when exit (funcall exit cand 'finished))
            (let ((want (and edit (dlm-test-apply orig edit))))
              (dlm-test "choosing it inserts exactly the item's textEdit" (and want (equal (buffer-string) want))
                        (format "buffer %S, expected %S" (buffer-string) want)))))))
    ;; A notification without a handler shows up as a warning in *Messages* / *Warnings* /
    ;; *lsp-log* / the events buffer: look for one about dlm/status in all of them.
    (let ((noise (cl-loop for b in (buffer-list)
                          for text = (with-current-buffer b (buffer-substring-no-properties (point-min) (point-max)))
                          when (string-match-p "[Uu]nknown notification[^\n]*dlm/status" text)
                          collect (buffer-name b))))
      (dlm-test "no unknown-notification warning for dlm/status" (null noise) (format "in %S" noise)))
    (pcase dlm-test-client
      ("lsp-mode" (ignore-errors (lsp-workspace-shutdown (car (lsp-workspaces)))))
      (_ (ignore-errors (eglot-shutdown (eglot-current-server)))))
    (delete-directory dir t))
  (kill-emacs (if (zerop dlm-test-failures) 0 1)))
