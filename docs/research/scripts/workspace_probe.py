# Research probe, kept as it ran at commit 1e9e59c; not maintained: it may not run against today's layout.
"""The workspace index's cost on a folder (docs/MODEL.md, "Session 20"): one walk's time and memory,
then cross_file at random cursors of one of its files.

    .venv/bin/python docs/research/scripts/workspace_probe.py /usr/lib/python3.11 json/decoder.py
"""
from __future__ import annotations

import json
import random
import resource
import sys
import time
from pathlib import Path

from dlm_lsp.fill.retrieval import SNIPPET_CHARS
from dlm_lsp.fill.workspace import WorkspaceIndex


def main(folder: str, rel: str, n: int = 50) -> dict:
    root = Path(folder)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ws = WorkspaceIndex([root], lambda lang: lang == "python", yield_s=0)
    t = time.perf_counter()
    files = ws.scan()
    scan_s = time.perf_counter() - t
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    path = root / rel
    text = path.read_text()
    ms = []
    for off in random.Random(0).sample(range(len(text)), n):
        t = time.perf_counter()
        ws.cross_file(path.absolute().as_uri(), text, off, "python", [], SNIPPET_CHARS)
        ms.append((time.perf_counter() - t) * 1000)
    first, rest = ms[0], sorted(ms[1:])
    return {"files": files, "text_mb": round(sum(s[1] for s in ws._seen.values()) / 1e6, 1),
            "windows": len(ws._indexes["python"]), "scan_s": round(scan_s, 2),
            "rss_growth_mb": round((rss1 - rss0) / 1024, 1), "first_search_ms": round(first, 2),
            "search_p50_ms": round(rest[len(rest) // 2], 2), "search_p95_ms": round(rest[int(len(rest) * 0.95)], 2)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
