# Research probe, kept as it ran at commit 9ec039d; not maintained: it may not run against today's layout.
"""The ceiling of a `jedi` names lever (issue 12, identifier-aware decoding) on the eval's seed-0
1,000 line holes: on how many holes the true text has an identifier that the names lever's known set
lacks (engine/bias/names.py: the job's texts, the far text, keywords, builtins), on how many of those
jedi's completions at the cursor would supply it, and what jedi costs per hole. jedi is not a
dependency of the project: `pip install jedi` first.

    .venv/bin/python docs/research/scripts/jedi_ceiling.py > docs/measurements/s16/jedi_ceiling_line1000.json
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import jedi  # noqa: E402

from dlm_lsp.fill.context import neighbour_text  # noqa: E402
from dlm_lsp.measure.evaluate import _request, load_files, sibling_files  # noqa: E402
from engine.bias import names  # noqa: E402
from dlm_lsp.measure.holes import cut_holes  # noqa: E402

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def main() -> None:
    files = load_files(None, None, "runs/corpus", "all")
    holes = cut_holes(files, 1000, 0, ("line",))["line"]
    texts = dict(files)
    sib = sibling_files(texts, 3)
    need = supplied = first_need = first_supplied = 0
    ms = []
    for h in holes:
        _, req = _request(h, neighbour_text([texts[o] for o in sib.get(h.key, [])]))
        known = names.names_in(req.prefix, req.suffix, req.far)
        # the true rest of the line's identifiers, the first one joined to the partial word at the cursor
        partial = re.search(r"[A-Za-z0-9_]*\Z", h.prefix).group(0)
        ids = NAME.findall(partial + h.middle)
        missing = [x for x in ids if x not in known]
        line, col = h.prefix.count("\n") + 1, len(h.prefix) - (h.prefix.rfind("\n") + 1)
        t = time.perf_counter()
        try:
            comps = {c.name for c in jedi.Script(code=h.prefix + h.text[h.b :]).complete(line, col)}
        except Exception:  # noqa: BLE001 - jedi failing on a file supplies nothing
            comps = set()
        ms.append((time.perf_counter() - t) * 1000)
        if missing:
            need += 1
            supplied += any(x in comps for x in missing)
        if ids and ids[0] not in known:
            first_need += 1
            first_supplied += ids[0] in comps
    print(json.dumps({"holes": len(holes), "need_unknown_name": need, "jedi_supplies_one": supplied,
                      "first_name_unknown": first_need, "jedi_supplies_first": first_supplied,
                      "jedi_ms_p50": statistics.median(ms), "jedi_ms_p95": sorted(ms)[int(0.95 * len(ms))],
                      "jedi_ms_mean": statistics.fmean(ms)}, indent=1))


if __name__ == "__main__":
    main()
