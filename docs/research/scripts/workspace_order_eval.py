# Research probe, kept as it ran at commit 6abd82e; not maintained: it may not run against today's layout.
"""Which files a big workspace's memory holds: the first in walk order, or the nearest to the
document being filled (dlm_lsp.fill.workspace: `focus`, WorkspaceIndex.files). Measured on a workspace
whose source is past the engine's workspace memory (MEMORY_CHARS): by default the `torch` package
of this checkout's .venv (2,285 files, 46 MB; not in the training corpus's manifest).

Line holes are cut from the files of --folders folders (of at least 3 files) drawn at random; every
hole is filled three times by the default model as `dlm-lsp eval` fills it (its gate, its
post-processing; no snippets or neighbours, so only the memory differs): without a workspace memory,
with the memory of the walk's first files (as the server filled it before the focus), and with the
memory a walk focused on the hole's file takes. A memory holds the files nearest first while their
bytes fit MEMORY_CHARS, as WorkspaceIndex.scan sends them; the hole's own file is left out of its
counts, as the server's jobs leave out the filled document. Writes each run's samples
(PREFIX.<run>.jsonl, for `dlm-lsp paired`) and a JSON summary:

    .venv/bin/python docs/research/scripts/workspace_order_eval.py --folders 20 --per-kind 400 --threads 1 \
        --samples-prefix runs/wsorder --json docs/measurements/s25/workspace_order.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from dlm_lsp.measure import evaluate as E  # noqa: E402
from dlm_lsp.fill import workspace as W  # noqa: E402
from dlm_lsp.measure.holes import cut_holes  # noqa: E402
from dlm_lsp.measure.paired import compare  # noqa: E402


def memory(files: list[tuple[Path, str]]) -> list[Path]:
    """The files a walk in this order sends the memory: nearest first while their bytes fit."""
    out, total = [], 0
    for path, _ in files:
        size = path.stat().st_size
        if size <= W.MAX_FILE_BYTES and total + size <= W.MEMORY_CHARS:
            total += size
            out.append(path)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="the workspace (default: the torch package of this .venv)")
    p.add_argument("--folders", type=int, default=20)
    p.add_argument("--per-kind", type=int, default=400, help="line holes in all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--samples-prefix", required=True)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args()
    if args.root:
        root = Path(args.root).resolve()
    else:
        import torch
        root = Path(torch.__file__).resolve().parent
    ws = W.WorkspaceIndex([root], serves=lambda lang: lang == "python", yield_s=0)
    walk = ws.files()
    in_walk_memory = set(memory(walk))
    by_folder: dict[Path, list[Path]] = {}
    for path, _ in walk:
        by_folder.setdefault(path.parent, []).append(path)
    folders = sorted(f for f, ps in by_folder.items() if len(ps) >= 3)
    chosen = random.Random(f"workspace-order:{args.seed}").sample(folders, min(args.folders, len(folders)))
    key_of = {path: f"{root.name}:{path.relative_to(root).as_posix()}" for path, _ in walk}
    path_of = {k: p for p, k in key_of.items()}
    files = [(key_of[p], p.read_text(encoding="utf-8", errors="replace")) for f in chosen for p in by_folder[f]]
    holes = cut_holes(files, args.per_kind, args.seed, ("line",))["line"]
    print(f"[wsorder] {root}: {len(walk)} files; {len(chosen)} folders, {len(files)} files, {len(holes)} line holes",
          file=sys.stderr, flush=True)

    dlm = E.DiffusionFiller(None, threads=args.threads)
    from dlm_lsp.fill.gate import Calibrator
    dlm.calibrator = Calibrator.from_json(dlm.service.serving.get("calibrator"))
    dlm.min_confidence = 0.0
    E.Filler.neighbours = E.Filler.snippets = None

    def give(name: str, paths: list[Path]) -> dict:
        texts = {key_of[p]: p.read_text(encoding="utf-8", errors="replace") for p in paths}
        return dlm.service.workspace_files(name, texts)

    runs: dict[str, dict] = {}
    t0 = time.time()
    with open(f"{args.samples_prefix}.none.jsonl", "w") as out:
        E.Filler.workspace = False
        runs["none"] = E.evaluate(dlm, {"line": holes}, "none", out)["line"]
    walk_mem = give("walk", sorted(in_walk_memory, key=lambda p: key_of[p]))
    with open(f"{args.samples_prefix}.walk.jsonl", "w") as out:
        E.Filler.workspace = lambda hole: "walk"
        runs["walk order"] = E.evaluate(dlm, {"line": holes}, "walk", out)["line"]
    dlm.service.workspace_drop("walk")
    near_sizes, near_samples = [], {}
    with open(f"{args.samples_prefix}.nearest.jsonl", "w") as out:
        for folder in chosen:  # one memory at a time: a walk focused on the folder's documents
            group = [h for h in holes if path_of[h.key].parent == folder]
            if not group:
                continue
            focused = W.WorkspaceIndex([root], serves=lambda lang: lang == "python", yield_s=0)
            focused.focus([path_of[group[0].key].as_uri()])
            near_sizes.append(give("near", memory(focused.files())))
            E.Filler.workspace = lambda hole: "near"
            kept: list = []
            E.evaluate(dlm, {"line": group}, "nearest", out, keep=kept)
            near_samples.update({id(h): s for h, s in zip(group, kept)})
            dlm.service.workspace_drop("near")
    E.Filler.workspace = False
    runs["nearest"] = E.score(holes, [near_samples[id(h)] for h in holes])
    # the nearest run's samples are in folder order: put them in the holes' order for the pairing
    order = {(h.key, h.describe()["line"], h.describe()["col"]): i for i, h in enumerate(holes)}
    got = [json.loads(line) for line in Path(f"{args.samples_prefix}.nearest.jsonl").read_text().splitlines()]
    got.sort(key=lambda s: order[(s["key"], s["line"], s["col"])])
    Path(f"{args.samples_prefix}.nearest.jsonl").write_text("".join(json.dumps(s) + "\n" for s in got))
    prefix = args.samples_prefix
    paired = {
        "walk order vs nearest": compare([(f"{prefix}.walk.jsonl", f"{prefix}.nearest.jsonl")])["line"],
        "none vs walk order": compare([(f"{prefix}.none.jsonl", f"{prefix}.walk.jsonl")])["line"],
        "none vs nearest": compare([(f"{prefix}.none.jsonl", f"{prefix}.nearest.jsonl")])["line"],
    }
    outside = {h.key for h in holes if path_of[h.key] not in in_walk_memory}
    result = {
        "root": str(root), "files": len(walk), "folders": [str(f.relative_to(root)) for f in chosen],
        "holes": len(holes), "holes_in_files_outside_the_walk_memory": sum(h.key in outside for h in holes),
        "memory_chars": W.MEMORY_CHARS, "walk_memory": walk_mem,
        "nearest_memory_tokens": [m["tokens"] for m in near_sizes],
        "runs": {k: {m: v[m] for m in ("exact", "edit_sim", "shown", "accepted", "accepted_chars") if m in v}
                 for k, v in runs.items()},
        "paired": paired, "elapsed_s": round(time.time() - t0, 1),
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
