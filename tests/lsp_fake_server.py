"""Runs the real dlm-lsp server over stdio with the scripted engine (tests/lsp_fake_engine.py)."""
import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from lsp_fake_engine import ScriptedEngine  # noqa: E402

from dlm_lsp.server import quiet_pygls, serve  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_pygls()
    sys.exit(serve(engine_factory=ScriptedEngine))
