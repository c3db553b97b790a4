"""Runs the real dlm-lsp server over stdio with the scripted engine (scripted_engine.py): the server a
`scripted:...` model runs in `dlm-lsp fuzz` and `dlm-lsp soak`, and the tests' fake server.

    python dlm_lsp/measure/fuzz/fake_server.py    (or: python -m dlm_lsp.measure.fuzz.fake_server)
"""

import logging
import sys
from pathlib import Path

if __name__ == "__main__":
    # run as a script: the folder holding dlm_lsp first, and this folder's modules not as top-level ones
    _here = Path(__file__).resolve().parent
    sys.path[:] = [str(_here.parents[2])] + [p for p in sys.path if Path(p or ".").resolve() != _here]

from dlm_lsp.measure.fuzz.scripted_engine import ScriptedEngine  # noqa: E402
from dlm_lsp.server import quiet_pygls, serve  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_pygls()
    sys.exit(serve(engine_factory=ScriptedEngine))
