"""`dlm-lsp serve`: its arguments, then the language server (dlm_lsp/server.py)."""

from __future__ import annotations

import argparse
import logging
import os


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stdio",
        action="store_true",
        help="talk LSP over stdin/stdout (the default; accepted for editors that pass it)",
    )
    p.add_argument("--log-file", default=None, help="also write the log to this file")
    p.add_argument(
        "--engine",
        choices=["shared", "inproc"],
        default=None,
        help="the user's shared engine daemon (default; DLM_ENGINE) or one in this process",
    )


def run_serve(args: argparse.Namespace) -> int:
    from dlm_lsp.server import quiet_pygls, serve

    quiet_pygls()
    if getattr(args, "log_file", None):
        h = logging.FileHandler(args.log_file)
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger().addHandler(h)
    if getattr(args, "engine", None):
        os.environ["DLM_ENGINE"] = args.engine  # read by default_engine_factory
    return serve()
