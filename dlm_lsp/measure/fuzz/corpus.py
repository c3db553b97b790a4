"""The code the fuzzer types: examples/, any folders the caller names, and a few stdlib modules."""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable
from pathlib import Path

from engine.paths import EXAMPLES_DIR


def load_corpus(extra_dirs: Iterable[str | Path] = ()) -> str:
    """Code to type: the examples, the *.py files of `extra_dirs` (in order; a checkout's tests pass
    tests/data) and a few stdlib modules."""
    import textwrap as _tw

    parts = [p.read_text(encoding="utf-8") for p in sorted(EXAMPLES_DIR.glob("*.py"))]
    for d in extra_dirs:
        parts += [p.read_text(encoding="utf-8") for p in sorted(Path(d).glob("*.py"))]
    for mod in (_tw, bisect, collections):
        if mod.__file__ is None:  # no source file: skipped
            continue
        try:
            parts.append(Path(mod.__file__).read_text(encoding="utf-8")[:20000])
        except OSError:
            pass
    return "\n".join(parts) or "def f(x):\n    return x + 1\n"
