"""Candidate (e) of the bake-off: a small student distilled from SmolLM2 (`dlm-lsp distill-targets`,
then `dlm-lsp train --distill DIR`).

The teacher (SmolLM2-135M, a plain causal Llama: engine/weights/base_models.py `load_causal_lm`) reads
windows of the corpus's train side and its next-token distributions become soft targets for the
student, this project's own 4 M diffusion model. The two do not share a tokenizer (49,152 ids vs
8,192), so a teacher distribution is carried over where both tokenizations have a token boundary at
the same character (92% of the student's boundaries on held-out code, docs/research/24-s15-candidate-e-distillation.md):

    teacher position j predicts its token j+1, which starts at character c;
    the student's token i starts at the same c  ->  target of student row i:
        p_s(t) = sum of p_T(v) over the teacher ids v whose text's first student token is t
               (`projection`: each teacher id's text encoded by the student, its first id kept)

A teacher id whose text is not whole UTF-8 (a byte piece) or is one of its special tokens maps to
nothing; its mass is dropped. Where the teacher token is shorter than the student's (`re` where the
student has `return`), the mass lands on the student's shorter token: an approximation, kept
because those boundaries are rare once both sides split on the same pre-tokenizer rules.

Each window keeps its student ids (`ids`), and per row the top-k projected ids and probabilities
(`top_ids`, `top_p`, fp16) and whether the row has a target (`has`). Windows are written in shards
(safetensors only) with a manifest (`targets.json`) that names the teacher (sha256 of its weights),
the student tokenizer (sha256 of tokenizer.json), k, the temperature and the windows so far; a second
call appends shards (the seed moves on with the count), so the teacher's CPU-hours can be spread
over sessions like a training run. The student's training (engine/train/loop.py, `--distill`) draws a
share of its masked-diffusion windows from these, and on their masked rows mixes the hard target's
cross-entropy with the soft targets' (`kd_loss`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from engine.model.transformer import Transformer
    from engine.train.objective import Example

MANIFEST = "targets.json"
FORMAT = 1


class DistillError(RuntimeError):
    """Targets that cannot be built or used; the message says what to do."""


def tokenizer_digest(tok: TextTokenizer) -> str:
    """sha256 of the tokenizer's serialized JSON: the student's ids mean nothing under another one."""
    return hashlib.sha256(tok.tok.to_str().encode("utf-8")).hexdigest()


def projection(
    teacher_tok: TextTokenizer, student_tok: TextTokenizer, specials: set[int] | None = None
) -> torch.Tensor:
    """(V_teacher,) long: for each teacher id, the student's first id of that id's text; -1 for the
    teacher's special tokens, empty texts and texts that are not whole UTF-8 (byte pieces)."""
    V = teacher_tok.vocab_size
    skip = set(specials or ()) | {i for i, t in teacher_tok.tok.get_added_tokens_decoder().items() if t.special}
    texts = [teacher_tok.token_text(i) for i in range(V)]
    keep = [i for i, t in enumerate(texts) if i not in skip and t and "\ufffd" not in t]
    out = torch.full((V,), -1, dtype=torch.long)
    for i, ids in zip(keep, student_tok.encode_batch([texts[i] for i in keep])):
        if ids:
            out[i] = ids[0]
    return out


def _offsets(tok: TextTokenizer, text: str) -> tuple[list[int], list[int]]:
    """(ids, start character of each token) of `text` with no special tokens."""
    e = tok.tok.encode(text, add_special_tokens=False)
    return e.ids, [a for a, _ in e.offsets]


@torch.no_grad()
def window_targets(
    teacher: Transformer,
    teacher_tok: TextTokenizer,
    proj: torch.Tensor,
    student_vocab: int,
    text: str,
    student_starts: list[int],
    k: int = 8,
    temperature: float = 1.0,
    max_teacher: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Soft targets for one student window: `text` is the window's text, `student_starts` its student
    tokens' start characters in it. Returns top_ids (L, k) long, top_p (L, k) float and has (L,) bool:
    row i has a target when a teacher token also starts at student_starts[i] and a teacher position
    before it predicts that token (never row 0)."""
    L = len(student_starts)
    top_ids = torch.zeros(L, k, dtype=torch.long)
    top_p = torch.zeros(L, k, dtype=torch.float32)
    has = torch.zeros(L, dtype=torch.bool)
    t_ids, t_starts = _offsets(teacher_tok, text)
    t_ids, t_starts = t_ids[:max_teacher], t_starts[:max_teacher]
    at: dict[int, int] = {}  # start character -> the teacher position that predicts the token starting there
    for j in range(1, len(t_ids)):
        at.setdefault(t_starts[j], j - 1)
    rows = [(i, at[c]) for i, c in enumerate(student_starts) if i > 0 and c in at]
    if not rows:
        return top_ids, top_p, has
    dev = next(teacher.parameters()).device  # the teacher's device (a GPU builds targets ~300x faster)
    logits = teacher(torch.tensor(t_ids, device=dev)[None])[0].float()  # (T, V_teacher)
    js = torch.tensor([j for _, j in rows], device=dev)
    p = (logits[js] / temperature).softmax(-1)  # (M, V_teacher)
    proj = proj.to(dev)
    ok = proj >= 0
    ps = torch.zeros(len(rows), student_vocab, device=dev).index_add_(1, proj[ok], p[:, ok])  # (M, V_student)
    vals, idx = ps.topk(min(k, student_vocab), dim=-1)
    vals, idx = vals.cpu(), idx.cpu()
    ii = torch.tensor([i for i, _ in rows])
    top_ids[ii, : idx.shape[1]], top_p[ii, : vals.shape[1]] = idx, vals
    has[ii] = True
    return top_ids, top_p, has


@dataclass
class Targets:
    """Every window of a targets folder, in memory as stored: ids (N, L) int32 (padding -1 past
    `lens`), top_ids (N, L, k) int32, top_p (N, L, k) fp16, has (N, L) uint8."""

    ids: torch.Tensor
    lens: torch.Tensor
    top_ids: torch.Tensor
    top_p: torch.Tensor
    has: torch.Tensor
    manifest: dict

    def __len__(self) -> int:
        return self.ids.shape[0]


def load_targets(folder: str | os.PathLike, student_tok: TextTokenizer | None = None) -> Targets:
    """The shards of a targets folder (safetensors only). With `student_tok`, refuses targets built
    for another student tokenizer."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        man = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DistillError(f"{folder}: no readable {MANIFEST} ({e}); build it with `dlm-lsp distill-targets`") from None
    if man.get("format") != FORMAT or not man.get("shards"):
        raise DistillError(
            f"{folder}/{MANIFEST}: format {man.get('format')!r} with {len(man.get('shards') or [])} shards; "
            f"this build reads format {FORMAT} with at least one shard"
        )
    if student_tok is not None and man.get("student_tokenizer") != tokenizer_digest(student_tok):
        raise DistillError(
            f"{folder}: the targets were built for another student tokenizer "
            f"(sha256 {str(man.get('student_tokenizer'))[:12]}...); rebuild them with this model's"
        )
    parts = [load_file(str(folder / s)) for s in man["shards"]]
    cat = lambda key: torch.cat([p[key] for p in parts])  # noqa: E731
    return Targets(cat("ids"), cat("lens"), cat("top_ids"), cat("top_p"), cat("has"), man)


def kd_example(t: Targets, ids_mask: int, rng: random.Random) -> Example:
    """A masked-diffusion example (engine/train/objective.py mdlm_example's masking: rate t ~ U(0.02, 1),
    weight 1 / (t * length)) over one teacher window, its masked rows carrying the soft targets."""
    from engine.train.objective import Example

    w = rng.randrange(len(t))
    n = int(t.lens[w])
    window = t.ids[w, :n].tolist()
    rate = rng.uniform(0.02, 1.0)
    inp, tgt = [], []
    for tok in window:
        if rng.random() < rate:
            inp.append(ids_mask)
            tgt.append(tok)
        else:
            inp.append(tok)
            tgt.append(-1)
    if all(x == -1 for x in tgt):
        i = rng.randrange(n)
        inp[i], tgt[i] = ids_mask, window[i]
    masked = torch.tensor([x >= 0 for x in tgt])
    p = t.top_p[w, :n].float() * (masked & t.has[w, :n].bool())[:, None]  # soft targets on masked rows only
    return Example(inp, tgt, 1.0 / (rate * n), soft=(t.top_ids[w, :n].long(), p))


def kd_loss(
    logits: torch.Tensor, tgt: torch.Tensor, soft_ids: torch.Tensor, soft_p: torch.Tensor, weight: float
) -> torch.Tensor:
    """Per row: (1 - weight) x the hard target's cross-entropy + weight x the soft targets'
    cross-entropy (top-k probabilities renormalized to 1); rows without soft targets keep the hard
    cross-entropy alone. logits (N, V), tgt (N,), soft_ids / soft_p (N, k)."""
    logp = logits.float().log_softmax(-1)
    hard = -logp.gather(1, tgt[:, None])[:, 0]
    mass = soft_p.sum(-1)
    has = mass > 0
    q = soft_p / mass.clamp_min(1e-12)[:, None]
    soft = -(q * logp.gather(1, soft_ids)).sum(-1)
    return torch.where(has, (1 - weight) * hard + weight * soft, hard)


# ---------------------------------------------------------------- building targets


def _windows(
    texts: list[str], tok: TextTokenizer, seq_len: int, rng: random.Random
) -> Iterator[tuple[str, list[int], list[int]]]:
    """Endless (window text, its student ids, their start characters in it): a file drawn by size, a
    random run of at most seq_len of its student tokens, the text from its first token's start to its
    last token's end."""
    import itertools

    cum = list(itertools.accumulate(len(t) for t in texts))
    while True:
        text = rng.choices(texts, cum_weights=cum)[0]
        e = tok.tok.encode(text, add_special_tokens=False)
        if len(e.ids) < 16:
            continue
        a = rng.randrange(0, max(1, len(e.ids) - seq_len))
        ids, offs = e.ids[a : a + seq_len], e.offsets[a : a + seq_len]
        c0 = offs[0][0]
        yield text[c0 : offs[-1][1]], ids, [s - c0 for s, _ in offs]


def build_targets(
    teacher: Transformer,
    teacher_tok: TextTokenizer,
    student_tok: TextTokenizer,
    texts: list[str],
    out: str | os.PathLike,
    windows: int | None = None,
    minutes: float | None = None,
    k: int = 8,
    seq_len: int = 512,
    temperature: float = 1.0,
    shard_windows: int = 64,
    seed: int = 0,
    teacher_id: dict | None = None,
    log: Callable[[str], object] = print,
) -> dict:
    """Appends shards of soft targets to `out` until `windows` more windows or `minutes` of wall time
    (whichever first); returns the manifest. The first shard fixes k, seq_len, the temperature and the
    tokenizers: a later call with others is refused."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / MANIFEST
    digest = tokenizer_digest(student_tok)
    want = {
        "format": FORMAT,
        "k": k,
        "seq_len": seq_len,
        "temperature": temperature,
        "student_tokenizer": digest,
        "teacher": teacher_id or {},
    }
    man: dict[str, Any] = (
        json.loads(mpath.read_text())
        if mpath.exists()
        else {**want, "shards": [], "windows": 0, "rows": 0, "rows_with_target": 0, "teacher_seconds": 0.0}
    )
    for key, v in want.items():
        if man.get(key) != v:
            raise DistillError(
                f"{out}: its targets were built with {key} = {man.get(key)!r}, not {v!r}; use another folder"
            )
    proj = projection(teacher_tok, student_tok)
    rng = random.Random(seed * 1_000_003 + man["windows"])
    gen = _windows(texts, student_tok, seq_len, rng)
    t0 = time.time()
    done = 0
    buf: list[tuple] = []

    def flush() -> None:
        nonlocal buf
        if not buf:
            return
        n = len(buf)
        ids = torch.full((n, seq_len), -1, dtype=torch.int32)
        lens = torch.zeros(n, dtype=torch.int32)
        tid = torch.zeros(n, seq_len, k, dtype=torch.int32)
        tp = torch.zeros(n, seq_len, k, dtype=torch.float16)
        has = torch.zeros(n, seq_len, dtype=torch.uint8)
        for r, (wi, a, b, h) in enumerate(buf):
            L = len(wi)
            ids[r, :L], lens[r] = torch.tensor(wi, dtype=torch.int32), L
            tid[r, :L], tp[r, :L], has[r, :L] = a.int(), b.half(), h.to(torch.uint8)
        name = f"shard-{len(man['shards']):05d}.safetensors"
        save_file({"ids": ids, "lens": lens, "top_ids": tid, "top_p": tp, "has": has}, str(out / name))
        man["shards"].append(name)
        man["windows"] += n
        man["rows"] += int(lens.sum())
        man["rows_with_target"] += int(has.sum())
        man["teacher_seconds"] = round(man["teacher_seconds"] + time.time() - t_flush[0], 1)
        t_flush[0] = time.time()
        tmp = mpath.with_name(MANIFEST + ".tmp")
        tmp.write_text(json.dumps(man, indent=1) + "\n")
        tmp.replace(mpath)
        log(
            f"[targets] {man['windows']} windows, {man['rows']} rows, {man['rows_with_target'] / max(1, man['rows']):.3f} "
            f"with a target; {man['rows'] / max(1e-9, man['teacher_seconds']):.0f} rows/s"
        )
        buf = []

    t_flush = [time.time()]
    while (windows is None or done < windows) and (minutes is None or time.time() - t0 < minutes * 60):
        text, ids, starts = next(gen)
        a, b, h = window_targets(teacher, teacher_tok, proj, student_tok.vocab_size, text, starts, k, temperature)
        buf.append((ids, a, b, h))
        done += 1
        if len(buf) >= shard_windows:
            flush()
    flush()
    return man


def add_distill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--teacher",
        default="runs/base/smollm2",
        help="the teacher: a plain Llama folder (`dlm-lsp base-model smollm2 --out DIR` writes SmolLM2's)",
    )
    p.add_argument("--student", default="models/default", help="the student checkpoint (its tokenizer.json is used)")
    p.add_argument(
        "--corpus", default="runs/corpus", help="a folder built by `dlm-lsp corpus` (its train side is read)"
    )
    p.add_argument("--out", default="runs/teacher", help="targets folder (shards are appended)")
    p.add_argument("--windows", type=int, default=None, help="stop after this many more windows")
    p.add_argument("--minutes", type=float, default=None, help="stop after this many wall-clock minutes")
    p.add_argument("--k", type=int, default=8, help="projected ids kept per row")
    p.add_argument("--seq-len", type=int, default=512, help="student tokens per window")
    p.add_argument("--temperature", type=float, default=1.0, help="the teacher's softmax temperature")
    p.add_argument("--shard-windows", type=int, default=64, help="windows per shard file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where the teacher runs (fp32; cuda builds targets far faster)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=None, help="only the first N train files (smoke runs)")


def run_distill(args: argparse.Namespace) -> int:
    from engine.model.weight_files import CheckpointError
    from engine.train import corpus
    from engine.weights import base_models

    torch.set_num_threads(max(1, args.threads))
    if args.windows is None and args.minutes is None:
        print("distill-targets: give --windows or --minutes", flush=True)
        return 2
    try:
        teacher, t_tok, _ = base_models.load_causal_lm(args.teacher, device=args.device)  # fp32 on either device
        s_tok = TextTokenizer.load(args.student)
        files = corpus.built_files(args.corpus)["train"]
    except (CheckpointError, OSError, FileNotFoundError) as e:
        print(f"distill-targets: {e}", flush=True)
        return 2
    if args.max_files:
        files = files[: args.max_files]
    texts = [t for t in (f.read() for f in files) if t]
    weights = sorted(Path(args.teacher).glob("*.safetensors"))
    teacher_id = {"folder": Path(args.teacher).name, "sha256": [base_models.sha256_file(w) for w in weights]}
    try:
        man = build_targets(
            teacher,
            t_tok,
            s_tok,
            texts,
            args.out,
            windows=args.windows,
            minutes=args.minutes,
            k=args.k,
            seq_len=args.seq_len,
            temperature=args.temperature,
            shard_windows=args.shard_windows,
            seed=args.seed,
            teacher_id=teacher_id,
        )
    except DistillError as e:
        print(f"distill-targets: {e}", flush=True)
        return 2
    print(
        f"{args.out}: {man['windows']} windows, {man['rows_with_target']} rows with a target "
        f"({man['teacher_seconds'] / 3600:.2f} teacher hours)",
        flush=True,
    )
    return 0


__all__ = [
    "DistillError",
    "Targets",
    "build_targets",
    "kd_example",
    "kd_loss",
    "load_targets",
    "projection",
    "tokenizer_digest",
    "window_targets",
]
