;;; eglot-check.el --- Batch check of eglot against dlm-lsp (completion fallback) -*- lexical-binding: t -*-
;; Not part of the automated tests. Run:
;;   DLM_LSP_CMD='dlm-lsp serve' emacs --batch -l editors/emacs/eglot-check.el
;; DLM_LSP_MODEL sets the `model` option; DLM_LSP_RAW=1 sends `postprocess: false` (the server's test
;; hook, so a small model's fill is not filtered to nothing).
;; Prints the server's name, the completion candidates in an empty loop body and the buffer after
;; choosing the first one the way `completion-at-point' does (insert the label, then :exit-function,
;; which applies the item's textEdit). Exits 1 when no candidate came back.
(require 'eglot)
(require 'python)
(setq eglot-sync-connect 120 eglot-connect-timeout 180)
(let ((cmd (split-string (or (getenv "DLM_LSP_CMD") "dlm-lsp serve")))
      (model (getenv "DLM_LSP_MODEL"))
      (raw (getenv "DLM_LSP_RAW")))
  (add-to-list 'eglot-server-programs
               `(python-mode . (,@cmd :initializationOptions
                                      (:budgetMs 2000
                                       ,@(and model (list :model model))
                                       ,@(and raw (list :postprocess :json-false)))))))
(let ((file (make-temp-file "dlm" nil ".py"
                            "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n"))
      (found nil))
  (find-file file)
  (python-mode)
  ;; eglot-ensure waits for a command loop that batch mode never runs; start it directly, in a
  ;; throwaway project rooted at the file's folder.
  (let ((project-find-functions (list (lambda (dir) (cons 'transient dir)))))
    (apply #'eglot (eglot--guess-contact)))
  (message "server: %S" (plist-get (eglot--server-info (eglot-current-server)) :name))
  (goto-char (point-min))
  (forward-line 6)
  (end-of-line)                         ; the empty loop body: a block hole
  ;; The first requests may come before the model is loaded (answered empty); ask a few times.
  (dotimes (_ 30)
    (unless found
      (let* ((capf (eglot-completion-at-point))
             (cands (all-completions "" (nth 2 capf))))
        (if (null cands)
            (sleep-for 1)
          (setq found t)
          (message "candidates: %S" (mapcar #'substring-no-properties cands))
          (insert (car cands))
          (funcall (plist-get (nthcdr 3 capf) :exit-function) (car cands) 'finished)
          (message "buffer after choosing the first candidate:\n%s" (buffer-string))))))
  (unless found (message "no completion candidates"))
  (kill-emacs (if found 0 1)))
