"""`dlm-lsp serve`: starts the engine the client announced (dlm_lsp/engines.py: DLM_LSP_PRESTART), then
imports and runs the language server (dlm_lsp/server.py), half a second of pygls and lsprotocol that
the engine's start no longer waits for."""

from __future__ import annotations

import argparse
import logging
import os

from dlm_lsp.engines import default_engine_factory, hold_logs, start_early


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`dlm-lsp serve`'s arguments (nothing heavy is imported to parse them)."""
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
    """Starts the engine (start_early), then imports and runs the server."""
    if getattr(args, "engine", None):
        os.environ["DLM_ENGINE"] = args.engine  # read by default_engine_factory and the hint's key
    hold_logs()  # until initialized: nothing on stderr before the initialize answer
    start_early(default_engine_factory)
    from dlm_lsp.server import quiet_pygls, serve

    quiet_pygls()
    if getattr(args, "log_file", None):
        h = logging.FileHandler(args.log_file)
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger().addHandler(h)
    return serve()
