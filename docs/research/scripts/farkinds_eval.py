# Research probe, kept as it ran at commit 5f2a4e4; not maintained: it may not run against today's layout.
"""`dlm-lsp eval` with the cross-file far text given to middle holes too (docs/MODEL.md, "Session 21").

The server gives the far text (the copy boost's far side and the names of the workspace snippets)
to rest-of-line holes only (`dlm_lsp.fill.context.FAR_KINDS`, session 7). This runs the eval with
FAR_KINDS = ("line", "middle"), every argument passed on:

    .venv/bin/python docs/research/scripts/farkinds_eval.py eval --corpus runs/corpus --heldout all --threads 1 \
        --neighbours 3 --retrieve package --min-confidence 0 --kinds middle --per-kind 300 --seed S --json F
"""
import sys

import dlm_lsp.fill.context as context

context.FAR_KINDS = ("line", "middle")

from dlm_lsp.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
