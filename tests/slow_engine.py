"""`dlm-lsp engine` with every denoising step slowed by DLM_TEST_STEP_MS (default 50): a daemon
whose jobs are still running when a test cancels them, kills the daemon or drops a connection."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.decode import sampler  # noqa: E402

_commit = sampler.commit
_delay = float(os.environ.get("DLM_TEST_STEP_MS", "50")) / 1000


def _slow_commit(*args, **kw):
    time.sleep(_delay)
    return _commit(*args, **kw)


sampler.commit = _slow_commit  # engine.serve.service calls sampler.commit once per step

from dlm_lsp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["engine", *sys.argv[1:]]))
