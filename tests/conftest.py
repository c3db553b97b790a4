"""The suite's servers run their engine in-process unless a test asks for the shared daemon
(tests/test_daemon.py does, with a private XDG_RUNTIME_DIR): a server test must not start, or
find, the user's own engine daemon."""

import os

from tests.families_tiny import family_folders  # noqa: F401 - the tiny family checkpoints, a fixture for every test

os.environ.setdefault("DLM_ENGINE", "inproc")
