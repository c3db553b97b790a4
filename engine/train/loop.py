"""`dlm-lsp train`: trains the default masked-diffusion code model (or its autoregressive twin).

Resumable: --resume reads a checkpoint folder (weights + tokenizer). When the folder also holds
optimizer.safetensors (the raw weights and AdamW's moments, written by every save), the run continues
where it stopped: same weights, same moments, no re-warm-up, and with --total-hours the same
warmup-stable-decay schedule planned over the whole budget of every segment together. Without it, a
fresh optimizer re-warms (the old behaviour). Checkpoints hold an EMA of the weights, so a copy taken
mid-run is already a good model. Writes a JSON log (train_log.jsonl), a curve (train_curve.png) and the split
manifest (split.json) into the output folder.
"""

from __future__ import annotations

import array
import itertools
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig
from engine.model.transformer import Transformer
from engine.tokenizer import BOS, EOS, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, MASK, PAD, SPECIALS, TextTokenizer, train_bpe
from engine.train import corpus, reorder
from engine.train.objective import Example, SpecialIds, collate, infill_example, mdlm_example, multi_infill_example
from engine.weights.checkpoint import save_checkpoint
from engine.weights.load import load_checkpoint

if TYPE_CHECKING:
    from engine.train.distill import Targets

Batch = dict[str, torch.Tensor]  # objective.collate's tensors


@dataclass
class TrainArgs:
    out: str = "runs/default"
    resume: str | None = None
    sources: list[str] = field(default_factory=list)
    corpus: str | None = None  # a folder built by `dlm-lsp corpus` (its train side; held-out for validation)
    objective: str = (
        "diffusion"  # "diffusion", "ar" (FIM-format causal twin) or "reorder" (recipe (c), engine/decode/reorder.py)
    )
    reorder_ar: float = 0.0  # reorder: weight of the auxiliary next-token loss on observed rows (0: off)
    minutes: float = 10.0
    max_steps: int | None = None
    # defaults: the shipped default model's recipe on this 2-core CPU (docs/MODEL.md); batch 16 x 512
    # at lr 1e-3 stalled on a plateau here, more and smaller steps did not
    batch: int = 8
    seq_len: int = 512
    lr: float = 6e-4
    warmup: int = 150
    weight_decay: float = 0.1
    ema: float = 0.999
    infill_share: float = 0.5
    infill_ordered: float = 0.5  # share of infill canvases revealed from the left (engine/train/objective.py)
    holes: int = 1  # holes per infill window (1: one canvas per window, the shipped recipe)
    total_hours: float | None = None  # warmup-stable-decay planned over this many training hours in all
    decay_share: float = 0.2  # last share of total_hours spent decaying the LR linearly to 10%
    # stop (and save) once the run's hours reach this, without changing the schedule: a checkpoint at
    # an exact point of the budget, to compare candidates at equal compute mid-run
    until_hours: float | None = None
    clock: str = "wall"  # "cpu": hours are this process's CPU time (every thread), fair on a shared machine
    ar_loss: str = "all"  # AR twin: loss on every token of the FIM document ("middle": the middle only)
    # AR-to-diffusion adaptation (recipe (b)): resuming a causal checkpoint with objective "diffusion"
    # keeps its head's one-position logit shift and anneals attention from causal to full over this
    # many steps (DiffuLLaMA: a random share of the future keys, rising linearly from 0 to 1)
    anneal_steps: int = 1000
    # the tokens-per-step phase (dParallel's certainty forcing, without the teacher): on target rows
    # the model already predicts right (argmax == target), `certainty` x the entropy of its
    # distribution joins the loss, so that more slots clear the decoder's confidence threshold in one
    # step. 0: off (the cross-entropy alone)
    certainty: float = 0.0
    # candidate (e), distillation (engine/train/distill.py): a folder of `dlm-lsp distill-targets`; that share
    # of the masked-diffusion windows comes from its teacher windows, whose masked rows mix the hard
    # cross-entropy with the teacher's soft targets', the latter weighted `kd_weight`
    distill: str | None = None
    kd_share: float = 0.25
    kd_weight: float = 0.5
    # next edits (engine/train/edit_objective.py): folders of edit cases, comma-separated (their "train"
    # side only), the share of examples that are edit canvases, the layouts' shares among them, and the
    # share of examples whose visible tokens are partly corrupted (C); 0: today's batches, bit for bit
    edit_data: str | None = None
    edit_share: float = 0.0
    edit_layouts: str = "window,surprise"
    correct_share: float = 0.0
    tokenizer_mb: float = 40.0  # text sample the tokenizer is trained on (whole files, spread over the corpus)
    vocab: int = 8192
    dim: int = 192
    n_layers: int = 5
    n_heads: int = 4
    ffn_dim: int = 576
    threads: int | None = None
    device: str = "cpu"
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 autocast on CUDA
    save_every_min: float = 10.0
    seed: int = 0
    max_files: int | None = None  # for tests: a tiny corpus
    tokenizer: str | None = None  # reuse this tokenizer.json (or folder) instead of training one
    stdlib: bool = True  # include the interpreter's stdlib (the GPU recipe trains on a packed copy instead)
    workers: int = 0  # processes building batches (0: on the training thread); a GPU step outruns one
    val_examples: int = 64
    progress: bool = True


def _special_ids(tok: TextTokenizer) -> SpecialIds:
    # this project's tokenizers (train_bpe) carry every SPECIALS token
    return SpecialIds(
        mask=cast(int, tok.token_id(MASK)), pad=cast(int, tok.token_id(PAD)), eos=cast(int, tok.token_id(EOS))
    )


def fim_example(
    text: str, tok: TextTokenizer, seq_len: int, ids: SpecialIds, rng: random.Random, loss: str = "middle"
) -> Example | None:
    """Autoregressive twin: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle <eos> (PSM),
    the same holes as the diffusion infill objective; loss on the middle and its end only, or (`all`,
    as AR FIM models are normally trained) on every token of the transformed document."""
    from engine.train.objective import cut_hole

    if len(text) < 20:
        return None
    a, b = cut_hole(text, rng)
    if b <= a:
        return None
    p_ids, m_ids, s_ids = tok.encode_batch([text[max(0, a - 3000) : a], text[a:b], text[b : b + 2000]])
    m_ids = m_ids[:64] + [ids.eos]
    # the FIM markers are SPECIALS: every tokenizer train_bpe builds has them
    fp, fs, fm = (cast(int, tok.token_id(t)) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE))
    room = seq_len - len(m_ids) - 3
    s_keep = min(len(s_ids), rng.randint(0, room // 2))
    p_keep = min(len(p_ids), room - s_keep)
    seq = [fp] + p_ids[len(p_ids) - p_keep :] + [fs] + s_ids[:s_keep] + [fm] + m_ids
    # next-token targets: position i predicts seq[i+1]; only middle tokens count
    start = 0 if loss == "all" else len(seq) - len(m_ids) - 1
    tgt = [-1] * len(seq)
    for i in range(start, len(seq) - 1):
        tgt[i] = seq[i + 1]
    return Example(seq, tgt, 1.0 / (len(seq) - 1 - start))


class Batches:
    """Draws training batches from the corpus with one RNG, so a seed fixes the data order."""

    def __init__(self, texts: list[str], tok: TextTokenizer, args: TrainArgs, seed: int):
        self.texts, self.tok, self.args = texts, tok, args
        self.rng = random.Random(seed)
        self.ids = _special_ids(tok)
        self.stream = array.array("i")  # int32: a list of Python ints would take ~36 bytes a token
        if args.objective in ("diffusion", "reorder"):
            for i in range(0, len(texts), 512):
                for ids in tok.encode_batch(texts[i : i + 512]):
                    self.stream.extend(ids)
                    self.stream.append(self.ids.eos)
        # sample files by size so big files are not under-represented
        self.cum_weights = list(itertools.accumulate(len(t) for t in texts))
        self.targets: Targets | None = None
        if args.distill:
            from engine.train.distill import load_targets

            if args.objective != "diffusion":
                raise SystemExit(f"--distill trains a diffusion student; --objective {args.objective} is not one")
            self.targets = load_targets(args.distill, tok)
        self.edit_cases: list[tuple[Path, dict]] = []
        self.edit_layouts: dict[str, float] = {}
        if (args.edit_share or args.correct_share) and args.objective != "diffusion":
            raise SystemExit(
                f"--edit-share and --correct-share train diffusion canvases, not --objective {args.objective}"
            )
        if args.edit_share:
            from engine.train.edit_objective import load_edit_cases, parse_layouts

            if not args.edit_data:
                raise SystemExit("--edit-share needs --edit-data: folders of edit cases (dlm-lsp corpus --edits)")
            try:
                self.edit_layouts = parse_layouts(args.edit_layouts)
                self.edit_cases = load_edit_cases([d for d in args.edit_data.split(",") if d])
            except ValueError as e:
                raise SystemExit(f"--edit-data / --edit-layouts: {e}") from None
            if not self.edit_cases:
                raise SystemExit(f'--edit-data {args.edit_data}: no case with side "train" in its *.jsonl files')
        if args.correct_share:
            from engine.train.edit_objective import window_pick

            self.special = {i for i in (tok.token_id(t) for t in SPECIALS) if i is not None}
            self.pick = window_pick(tok, self.special)

    def edit_example(self) -> Example | None:
        """An edit canvas of a random case in a layout drawn by its share; a case whose edits do not
        apply to its file is dropped."""
        from engine.train.edit_objective import case_example

        k = self.rng.randrange(len(self.edit_cases))
        layout = self.rng.choices(list(self.edit_layouts), weights=list(self.edit_layouts.values()))[0]
        folder, case = self.edit_cases[k]
        try:
            return case_example(
                folder, case, self.tok, self.args.seq_len, self.ids, self.rng, layout, self.args.infill_ordered
            )
        except ValueError as e:
            print(f"edit case {case.get('id', k)} dropped: {e}", file=sys.stderr, flush=True)
            self.edit_cases.pop(k)
            if not self.edit_cases:
                raise SystemExit("--edit-data: no edit case applies to its file") from None
            return None

    def example(self) -> Example:
        a = self.args
        while True:
            if a.objective == "ar":
                ex = fim_example(
                    self.rng.choices(self.texts, cum_weights=self.cum_weights)[0],
                    self.tok,
                    a.seq_len,
                    self.ids,
                    self.rng,
                    loss=a.ar_loss,
                )
            elif a.objective == "reorder":  # causal, observed rows first, masks last (engine/decode/reorder.py)
                if self.rng.random() < a.infill_share:
                    ex = reorder.infill_example(
                        self.rng.choices(self.texts, cum_weights=self.cum_weights)[0],
                        self.tok,
                        a.seq_len,
                        self.ids,
                        self.rng,
                        holes=a.holes,
                        ordered=a.infill_ordered,
                        ar_weight=a.reorder_ar,
                    )
                else:
                    ex = reorder.window_example(self.stream, a.seq_len, self.ids, self.rng, ar_weight=a.reorder_ar)
            elif a.edit_share and self.rng.random() < a.edit_share:  # no draw at 0: the old batches
                ex = self.edit_example()
            elif self.rng.random() < a.infill_share:
                text = self.rng.choices(self.texts, cum_weights=self.cum_weights)[0]
                if a.holes > 1:
                    ex = multi_infill_example(
                        text, self.tok, a.seq_len, self.ids, self.rng, holes=a.holes, ordered=a.infill_ordered
                    )
                else:
                    ex = infill_example(text, self.tok, a.seq_len, self.ids, self.rng, ordered=a.infill_ordered)
            elif self.targets is not None and self.rng.random() < a.kd_share:
                from engine.train.distill import kd_example

                ex = kd_example(self.targets, self.ids.mask, self.rng)
            else:
                ex = mdlm_example(self.stream, a.seq_len, self.ids, self.rng)
            if ex is not None and a.correct_share and ex.soft is None and self.rng.random() < a.correct_share:
                from engine.train.edit_objective import CORRUPT_TOKENS, corrupt_visible

                ex = corrupt_visible(ex, self.rng, CORRUPT_TOKENS, self.pick, self.special)
            if ex is not None:
                return ex

    def batch(self, n: int) -> Batch:
        examples = [self.example() for _ in range(n)]
        if self.args.objective == "reorder":  # reorder.infill_example / window_example only
            return reorder.collate_reorder(cast(list[reorder.ReorderExample], examples), self.ids.pad)
        return collate(examples, self.ids.pad)


class _BatchSource(torch.utils.data.IterableDataset[Batch]):
    """Endless batches for DataLoader workers; each worker draws with its own seed."""

    def __init__(self, data: Batches, n: int, seed: int):
        self.data, self.n, self.seed = data, n, seed

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        if info is not None:  # forked copies share the parent's RNG state: give each its own
            self.data.rng = random.Random(self.seed * 1000 + info.id)
            # the parent encoded the corpus with the tokenizer's thread pool; in a forked child that pool
            # deadlocks unless parallelism is off (TOKENIZERS_PARALLELISM=true would force it on)
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        while True:
            yield self.data.batch(self.n)


def held_out_args(args: TrainArgs) -> TrainArgs:
    """The held-out batches' arguments: server-shaped infill, one hole a window, without the AR twin's
    whole-document loss, distillation or the edit objectives, so runs with and without them compare."""
    return TrainArgs(
        **{
            **asdict(args),
            "infill_share": 1.0,
            "holes": 1,
            "ar_loss": "middle",
            "reorder_ar": 0.0,
            "distill": None,
            "edit_share": 0.0,
            "correct_share": 0.0,
        }
    )


def batch_stream(data: Batches, n: int, workers: int, seed: int, pin: bool = False) -> Iterator[Batch]:
    """Yields training batches, built inline (workers=0) or by `workers` processes."""
    if workers <= 0:
        while True:
            yield data.batch(n)
    import multiprocessing

    # fork: the workers inherit the tokenized corpus instead of unpickling it (spawn/forkserver)
    ctx = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    loader = torch.utils.data.DataLoader(
        _BatchSource(data, n, seed),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4,
        persistent_workers=True,
        pin_memory=pin,
        multiprocessing_context=ctx,
    )
    yield from loader


def anneal_mask(valid: torch.Tensor, ratio: float, gen: torch.Generator | None = None) -> torch.Tensor:
    """(B, 1, L, L) attention mask of AR-to-diffusion adaptation (DiffuLLaMA's attention annealing):
    a query sees every earlier key and itself, plus each later key with probability `ratio`; batch
    padding is never seen."""
    B, L = valid.shape
    causal = torch.ones(L, L, dtype=torch.bool, device=valid.device).tril()
    future = torch.rand(B, 1, L, L, generator=gen, device=valid.device) < ratio
    return (causal | future) & valid[:, None, None, :] | torch.eye(L, dtype=torch.bool, device=valid.device)


def shift_targets(tgt: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted logits (`logits_shift`): the output at position i predicts token i+1, so each target
    moves one position to the left (a target at position 0 has no predictor and is dropped)."""
    t, ww = torch.full_like(tgt, -1), torch.zeros_like(w)
    t[:, :-1], ww[:, :-1] = tgt[:, 1:], w[:, 1:]
    return t, ww


def shift_rows(x: torch.Tensor) -> torch.Tensor:
    """shift_targets for per-position rows (B, L, ...): row i takes row i+1's, the last row zeros."""
    out = torch.zeros_like(x)
    out[:, :-1] = x[:, 1:]
    return out


def loss_on(
    model: Transformer,
    b: Batch,
    device: torch.device | str,
    autocast: Callable[[], AbstractContextManager[object]],
    attn_ratio: float = 1.0,
    certainty: float = 0.0,
    kd_weight: float = 0.0,
) -> torch.Tensor:
    """Weighted cross-entropy on target positions only: the LM head runs on those rows alone.
    Shifted models read each target one position to the left; `attn_ratio` < 1 (a bidirectional
    model being adapted from a causal one) trains under `anneal_mask`. `certainty` > 0 adds that
    times the entropy of the rows whose argmax is already the target (TrainArgs.certainty). With soft
    targets in the batch (distillation) and `kd_weight` > 0, their rows' loss is distill.kd_loss."""
    ids, tgt, valid, w = (b[k].to(device) for k in ("ids", "targets", "key_valid", "weights"))
    soft = (b["soft_ids"].to(device), b["soft_p"].to(device)) if kd_weight and "soft_p" in b else None
    if model.cfg.logits_shift and model.cfg.attention != "causal":
        tgt, w = shift_targets(tgt, w)
        if soft is not None:
            soft = (shift_rows(soft[0]), shift_rows(soft[1]))
    mask = anneal_mask(valid, attn_ratio) if attn_ratio < 1.0 and not model.causal else None
    with autocast():
        pos = b["pos"].to(device) if "pos" in b else None  # the reorder layout's logical positions
        h = model.hidden(ids, pos=pos, key_valid=valid, attn_mask=mask)  # (B, L, D)
    sel = tgt >= 0
    logits = model.logits(h[sel].float() if h.dtype != torch.float32 else h[sel])  # (N, V)
    if soft is not None:
        from engine.train.distill import kd_loss

        ce = kd_loss(logits, tgt[sel], soft[0][sel], soft[1][sel], kd_weight)
    else:
        ce = F.cross_entropy(logits.float(), tgt[sel], reduction="none")
    loss = (ce * w[sel]).sum() / ids.shape[0]
    if certainty:
        logp = logits.float().log_softmax(-1)
        ent = -(logp.exp() * logp).sum(-1)
        right = (logits.argmax(-1) == tgt[sel]).float()
        loss = loss + certainty * (ent * right * w[sel]).sum() / ids.shape[0]
    return loss


OPTIMIZER_FILE = "optimizer.safetensors"


def wsd_lr(args: TrainArgs, step: int, hours: float, warm_from: int = 0) -> float:
    """Warmup-stable-decay over the whole planned run: linear warm-up over `warmup` steps (counted from
    `warm_from`, the step a fresh optimizer started at), the peak LR, then a linear decay to 10% of it
    over the last `decay_share` of `total_hours`."""
    assert args.total_hours is not None, "wsd_lr plans over --total-hours"
    lr = args.lr * min(1.0, (step - warm_from + 1) / args.warmup)
    start = args.total_hours * (1 - args.decay_share)
    if hours > start:
        lr *= max(0.1, 1 - 0.9 * (hours - start) / max(1e-9, args.total_hours - start))
    return lr


def tokenizer_sample(texts: list[str], mb: float) -> list[str]:
    """Whole files spread evenly over the corpus, about `mb` MB in all (the tokenizer sees every source)."""
    total = sum(map(len, texts))
    if total <= mb * 1e6:
        return texts
    every = total / (mb * 1e6)
    out, acc = [], 0.0
    for t in texts:
        acc += 1
        if acc >= every:
            acc -= every
            out.append(t)
    return out


def save_optimizer(path: Path, opt: torch.optim.AdamW, model: Transformer) -> None:
    """The raw (not EMA) weights in fp32 and AdamW's moments in bf16 (half the bytes; the moments are
    running averages, their 3 significant digits are plenty) plus each parameter's step, as safetensors."""
    from safetensors.torch import save_file

    tensors, steps = {}, {}
    for name, p in model.named_parameters():
        tensors[f"weight.{name}"] = p.detach().float().contiguous().cpu()
        st = opt.state.get(p)
        if st:
            tensors[f"exp_avg.{name}"] = st["exp_avg"].detach().to(torch.bfloat16).contiguous().cpu()
            tensors[f"exp_avg_sq.{name}"] = st["exp_avg_sq"].detach().to(torch.bfloat16).contiguous().cpu()
            steps[name] = float(st["step"])
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"steps": json.dumps(steps)})
    tmp.replace(path)


def slim_optimizer(path: Path) -> None:
    """Rewrites an optimizer file without its raw weights (moments and steps kept): a checkpoint to
    commit costs 16 MB less at the 4 M shape, and a resume from it continues from the EMA weights
    (load_raw_weights finds none) on the same schedule and moments, without re-warm-up."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("weight.")}
    tmp = path.with_name(path.name + ".tmp")
    save_file(kept, str(tmp), metadata=meta)
    tmp.replace(path)


def load_raw_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k[len("weight.") :]: f.get_tensor(k) for k in f.keys() if k.startswith("weight.")}


def load_optimizer(opt: torch.optim.AdamW, model: Transformer, path: Path) -> None:
    """Restores the moments saved by save_optimizer into a fresh AdamW over the same parameters."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        steps = json.loads((f.metadata() or {}).get("steps", "{}"))
        keys = set(f.keys())
        for name, p in model.named_parameters():
            if f"exp_avg.{name}" not in keys:
                continue
            opt.state[p] = {
                "step": torch.tensor(steps.get(name, 0.0)),
                "exp_avg": f.get_tensor(f"exp_avg.{name}").float().to(p.device),
                "exp_avg_sq": f.get_tensor(f"exp_avg_sq.{name}").float().to(p.device),
            }


def _plot(log_path: Path, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(l) for l in log_path.read_text().splitlines() if l.strip()]
    tr = [r for r in rows if "loss" in r]
    va = [r for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot([r["hours"] for r in tr], [r["loss"] for r in tr], lw=0.8, label="train loss (EMA of batches)")
    if va:
        ax.plot([r["hours"] for r in va], [r["val_loss"] for r in va], "o-", label="held-out infill loss")
    ax.set_xlabel("training hours (this model, all runs)")
    ax.set_ylabel("loss (nats, weighted)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def train(args: TrainArgs) -> Path:
    """Trains for args.minutes (or max_steps) and returns the output folder."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    use_bf16 = device.type == "cuda" and args.dtype in ("auto", "bf16")
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if use_bf16
        else (lambda: torch.autocast("cpu", enabled=False))
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.corpus:
        sides = corpus.built_files(args.corpus)
        train_files, held_files = sides["train"], sides["heldout"] + sides["heldout_packages"]
    else:
        files = corpus.collect([Path(s) for s in args.sources], include_stdlib=args.stdlib)
        train_files, held_files = corpus.split(files)
    if args.max_files:
        train_files, held_files = train_files[: args.max_files], held_files[: max(2, args.max_files // 10)]
    corpus.write_manifest(out / "split.json", train_files, held_files)
    texts = [t for t in (f.read() for f in train_files) if t]
    held_texts = [t for t in (f.read() for f in held_files) if t]
    print(
        f"corpus: {len(texts)} train files ({sum(map(len, texts)) / 1e6:.1f} MB), {len(held_texts)} held out",
        flush=True,
    )

    prior_hours, prior_tokens, step0, anneal_from = 0.0, 0, 0, None
    if args.resume:
        model, tok, cfg = load_checkpoint(args.resume, device="cpu")
        if args.seq_len > (cfg.context_len or 0):  # longer windows from now on: fills may use them
            cfg.context_len = min(args.seq_len, cfg.max_seq_len)
        model.train()
        st = Path(args.resume) / "training_state.json"
        if st.exists():
            s = json.loads(st.read_text())
            prior_hours, prior_tokens, step0 = s.get("hours", 0.0), s.get("tokens", 0), s.get("step", 0)
        anneal_from = s.get("anneal_from") if st.exists() else None
        if args.objective == "reorder" or cfg.canvas == "reorder":  # recipe (c): causal, reordered canvases
            if cfg.attention != "causal" or cfg.logits_shift or args.objective != "reorder":
                raise SystemExit(
                    f"--objective {args.objective} cannot resume a {cfg.attention} checkpoint "
                    f"with canvas {cfg.canvas!r}"
                )
            cfg.canvas = "reorder"  # an AR checkpoint (the twin) starts recipe (c) with its weights unchanged
        elif cfg.attention == "causal" and args.objective == "diffusion":  # recipe (b): adapt an AR model
            cfg.attention, cfg.logits_shift, anneal_from = "bidirectional", True, step0
            print(
                f"adapting a causal checkpoint to diffusion: logit shift, attention annealed over {args.anneal_steps} steps",
                flush=True,
            )
        elif args.objective == "ar" and cfg.attention != "causal":
            raise SystemExit(f"--objective {args.objective} cannot resume a {cfg.attention} checkpoint")
        prev_log = Path(args.resume) / "train_log.jsonl"
        if prev_log.exists() and prev_log.resolve() != (out / "train_log.jsonl").resolve():
            shutil.copy(prev_log, out / "train_log.jsonl")
        print(f"resumed from {args.resume}: {prior_hours:.2f} h, step {step0}", flush=True)
    else:
        tok = (
            TextTokenizer.load(args.tokenizer)
            if args.tokenizer
            else train_bpe(tokenizer_sample(texts, args.tokenizer_mb), args.vocab)
        )
        cfg = ModelConfig(
            vocab_size=tok.vocab_size,
            dim=args.dim,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            ffn_dim=args.ffn_dim,
            max_seq_len=max(1024, args.seq_len),
            context_len=args.seq_len,
            attention="causal" if args.objective in ("ar", "reorder") else "bidirectional",
            canvas="reorder" if args.objective == "reorder" else None,
            mask_token_id=cast(int, tok.token_id(MASK)),  # SPECIALS: in every tokenizer train_bpe builds
            pad_token_id=cast(int, tok.token_id(PAD)),
            eos_token_id=cast(int, tok.token_id(EOS)),
            bos_token_id=tok.token_id(BOS),
        ).validate()
        model = Transformer(cfg)
        model.init_weights(args.seed)
        (out / "train_log.jsonl").write_text("")
    model.to(device)
    print(f"model: {model.num_params() / 1e6:.2f}M params, {cfg.attention}", flush=True)

    ema = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    opt_state = Path(args.resume) / OPTIMIZER_FILE if args.resume else None
    if opt_state is not None and opt_state.exists():
        raw = load_raw_weights(opt_state)
        model.load_state_dict({k: raw.get(k, v) for k, v in model.state_dict().items()})
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    resumed_opt = opt_state is not None and opt_state.exists()
    if resumed_opt and opt_state is not None:
        load_optimizer(opt, model, opt_state)
        print(f"optimizer state restored from {opt_state}: no re-warm-up", flush=True)
    data = Batches(texts, tok, args, seed=args.seed + step0)
    if data.edit_cases:
        print(
            f"edit data: {len(data.edit_cases)} train cases, {args.edit_share:.0%} of the examples "
            f"({', '.join(f'{k} {v:.0%}' for k, v in data.edit_layouts.items())})",
            flush=True,
        )
    batches = batch_stream(data, args.batch, args.workers, args.seed + step0, pin=device.type == "cuda")
    # fixed held-out infill examples: the same holes and masks at every evaluation
    val = Batches(held_texts or texts[:5], tok, held_out_args(args), seed=12345)
    val_batches = [val.batch(min(16, args.val_examples)) for _ in range(max(1, args.val_examples // 16))]

    log = (out / "train_log.jsonl").open("a")
    budget_s = args.minutes * 60
    t0 = time.time()
    c0 = time.process_time()
    last_save = t0
    best = math.inf
    bestf = out / "best_val.json"
    if bestf.exists():
        best = json.loads(bestf.read_text()).get("val_loss", math.inf)
    step, tokens, smooth = step0, prior_tokens, None
    bar = None
    if args.progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=int(budget_s), unit="s", mininterval=30, file=sys.stderr, desc="train")
        except ImportError:
            bar = None

    def hours_now() -> float:
        if args.clock == "cpu":  # equal compute for jobs that share the cores (bake-offs side by side)
            return prior_hours + (time.process_time() - c0) / 3600
        return prior_hours + (time.time() - t0) / 3600

    def evaluate() -> float:
        model.eval()
        backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict({k: v.to(backup[k].dtype) for k, v in ema.items()})
        with torch.no_grad():
            vl = sum(float(loss_on(model, b, device, autocast)) for b in val_batches) / len(val_batches)
        model.load_state_dict(backup)
        model.train()
        return vl

    def save(final: bool = False) -> None:
        nonlocal best, last_save
        vl = evaluate()
        rec = {"step": step, "hours": round(hours_now(), 4), "val_loss": round(vl, 4), "tokens": tokens}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        state = {"step": step, "hours": hours_now(), "tokens": tokens, "val_loss": vl, "args": asdict(args)}
        if anneal_from is not None:
            state["anneal_from"] = anneal_from
        if data.edit_cases:
            state["edit_cases"] = len(data.edit_cases)
        ema_model = Transformer(cfg)
        ema_model.load_state_dict({k: v.cpu() for k, v in ema.items()})
        save_checkpoint(out / "last", ema_model, tok, state)
        save_optimizer(out / "last" / OPTIMIZER_FILE, opt, model)
        shutil.copy(out / "train_log.jsonl", out / "last" / "train_log.jsonl")
        if vl < best:
            best = vl
            save_checkpoint(out / "best", ema_model, tok, state)
            save_optimizer(out / "best" / OPTIMIZER_FILE, opt, model)
            shutil.copy(out / "train_log.jsonl", out / "best" / "train_log.jsonl")
            bestf.write_text(json.dumps({"val_loss": vl, "step": step}) + "\n")
        _plot(out / "train_log.jsonl", out / "train_curve.png")
        for d in ("last", "best"):
            if (out / d).exists():
                shutil.copy(out / "train_curve.png", out / d / "train_curve.png") if (
                    out / "train_curve.png"
                ).exists() else None
        print(f"[save] step {step} val {vl:.4f} best {best:.4f} ({hours_now():.2f} h)", flush=True)
        last_save = time.time()

    model.train()
    local = 0
    stop = _StopOnSignal()
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget_s or (args.max_steps is not None and local >= args.max_steps):
            break
        if stop.asked:
            print(f"signal {stop.asked}: stopping at step {step}, the checkpoint saved", flush=True)
            break
        if args.total_hours is not None and hours_now() >= args.total_hours:
            print(f"planned budget of {args.total_hours} h reached", flush=True)
            break
        if args.until_hours is not None and hours_now() >= args.until_hours:
            print(f"--until-hours {args.until_hours} reached", flush=True)
            break
        if args.total_hours is not None:  # one schedule over every segment of the run
            lr = wsd_lr(args, step, hours_now(), warm_from=0 if resumed_opt else step0)
        else:  # warm-up, then constant, then a linear cool-down over the last 15% of this run's budget
            frac = elapsed / budget_s
            lr = args.lr * min(1.0, (local + 1) / args.warmup)
            if frac > 0.85:
                lr *= max(0.1, (1 - frac) / 0.15)
        for g in opt.param_groups:
            g["lr"] = lr
        b = next(batches)
        ratio = 1.0 if anneal_from is None else min(1.0, (step - anneal_from) / max(1, args.anneal_steps))
        loss = loss_on(
            model,
            b,
            device,
            autocast,
            attn_ratio=ratio,
            certainty=args.certainty,
            kd_weight=args.kd_weight if args.distill else 0.0,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # the EMA's horizon grows with the run, so an early checkpoint is not mostly the random init; a
        # resume that restored the optimizer continues the run, so its EMA (the checkpoint's weights)
        # keeps the horizon it had instead of restarting from the raw weights at every segment
        ema_step = step if resumed_opt else local
        ema_decay = min(args.ema, (1 + ema_step) / (10 + ema_step))
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].mul_(ema_decay).add_(v.float(), alpha=1 - ema_decay)
        step += 1
        local += 1
        tokens += int(b["key_valid"].sum())
        li = loss.item()
        smooth = li if smooth is None else 0.98 * smooth + 0.02 * li
        if local % 20 == 0:
            tps = (tokens - prior_tokens) / max(1e-6, time.time() - t0)
            log.write(
                json.dumps(
                    {
                        "step": step,
                        "hours": round(hours_now(), 4),
                        "loss": round(smooth, 4),
                        "lr": lr,
                        "tok_s": round(tps),
                    }
                )
                + "\n"
            )
            log.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{smooth:.3f}", tok_s=f"{tps:.0f}", step=step)
                bar.update(int(time.time() - t0) - bar.n)
        if time.time() - last_save > args.save_every_min * 60:
            save()
    save(final=True)
    stop.restore()
    if bar is not None:
        bar.close()
    log.close()
    return out


class _StopOnSignal:
    """SIGTERM / SIGINT during training end it after the step under way, with the final save (a
    background run is stopped with `kill PID` and loses nothing); the old handlers come back at the
    end. Only in the main thread, where Python delivers signals."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.asked: str | None = None
        self.old: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.old[sig] = signal.signal(sig, self._ask)

    def _ask(self, signum: int, frame: FrameType | None) -> None:
        self.asked = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)
