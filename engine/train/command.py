"""`dlm-lsp train`: its flags (every field of `TrainArgs`) and the run, so that the CLI's table names a
module here and `dlm_lsp/cli.py` holds no training code."""

from __future__ import annotations

import argparse


def add_train_args(p: argparse.ArgumentParser) -> None:
    from engine.train.loop import TrainArgs

    d = TrainArgs()
    p.add_argument("--out", default=d.out, help="output folder (checkpoints in OUT/last and OUT/best)")
    p.add_argument("--resume", default=None, help="checkpoint folder to continue from")
    p.add_argument(
        "--source", dest="sources", action="append", default=[], help="extra folder of .py files (repeatable)"
    )
    p.add_argument("--corpus", default=None, help="a folder built by `dlm-lsp corpus` (replaces the stdlib + --source)")
    p.add_argument("--holes", type=int, default=d.holes, help="holes per infill window (several canvases a window)")
    p.add_argument(
        "--total-hours",
        type=float,
        default=None,
        help="plan one warmup-stable-decay schedule over this many training hours, across resumes",
    )
    p.add_argument(
        "--until-hours",
        type=float,
        default=None,
        help="stop and save once the run's hours reach this (the schedule stays --total-hours')",
    )
    p.add_argument(
        "--decay-share", type=float, default=d.decay_share, help="last share of --total-hours that decays the LR"
    )
    p.add_argument("--tokenizer-mb", type=float, default=d.tokenizer_mb, help="MB of text the tokenizer is trained on")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default=d.clock,
        help="what --minutes / --total-hours count: wall time, or this process's CPU time (shared machine)",
    )
    p.add_argument(
        "--ar-loss",
        choices=["all", "middle"],
        default=d.ar_loss,
        help="AR twin: loss on every token of the FIM document, or on the middle only",
    )
    p.add_argument(
        "--anneal-steps",
        type=int,
        default=d.anneal_steps,
        help="adapting a causal (AR) checkpoint with --objective diffusion: steps of causal-to-full attention annealing",
    )
    p.add_argument(
        "--certainty",
        type=float,
        default=d.certainty,
        help="tokens-per-step phase: weight of the entropy of rows already predicted right (0: off)",
    )
    p.add_argument(
        "--distill",
        default=None,
        help="candidate (e): a folder of `dlm-lsp distill-targets`; a share of the windows carry the teacher's soft targets",
    )
    p.add_argument(
        "--kd-share", type=float, default=d.kd_share, help="--distill: share of the masked-diffusion windows from it"
    )
    p.add_argument(
        "--kd-weight",
        type=float,
        default=d.kd_weight,
        help="--distill: weight of the soft targets' cross-entropy on their rows (the hard target's gets 1 - it)",
    )
    p.add_argument(
        "--edit-data",
        default=None,
        metavar="DIR[,DIR...]",
        help="folders of next-edit cases (dlm-lsp corpus --edits, synthetic edits): every *.jsonl in them, its cases "
        'with side "train" only (never "heldout" or "heldout_packages")',
    )
    p.add_argument(
        "--edit-share",
        type=float,
        default=d.edit_share,
        help="share of the examples that are next-edit canvases from --edit-data (0: off)",
    )
    p.add_argument(
        "--edit-layouts",
        default=d.edit_layouts,
        help='the edit canvases\' layouts and their shares: "window,surprise" (equal) or "window:3,surprise:1"',
    )
    p.add_argument(
        "--correct-share",
        type=float,
        default=d.correct_share,
        help="share of the examples with some visible tokens made wrong, every visible token a target (0: off)",
    )
    p.add_argument("--val-examples", type=int, default=d.val_examples, help="held-out infill examples per validation")
    p.add_argument(
        "--objective",
        choices=["diffusion", "ar", "reorder"],
        default=d.objective,
        help="reorder: causal diffusion with observed tokens first, masks last (recipe (c), engine/decode/reorder.py)",
    )
    p.add_argument(
        "--reorder-ar",
        type=float,
        default=d.reorder_ar,
        help="--objective reorder: weight of the auxiliary next-token loss on observed rows (0: off)",
    )
    p.add_argument("--minutes", type=float, default=d.minutes, help="wall-clock budget")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--infill-share", type=float, default=d.infill_share, help="share of server-shaped infill examples")
    p.add_argument(
        "--infill-ordered",
        type=float,
        default=d.infill_ordered,
        help="share of infill canvases revealed from the left (where a fill ends)",
    )
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json (or folder) instead of training one")
    p.add_argument("--workers", type=int, default=d.workers, help="processes building batches (GPU runs)")
    p.add_argument("--no-stdlib", dest="stdlib", action="store_false", help="train on --source folders only")
    p.add_argument("--warmup", type=int, default=d.warmup)
    for k in ("vocab", "dim", "n_layers", "n_heads", "ffn_dim"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=getattr(d, k))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 leaves a core free)")
    p.add_argument("--device", default=d.device, help="cpu or cuda (bf16 autocast on cuda)")
    p.add_argument("--save-every-min", type=float, default=d.save_every_min)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (smoke runs)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", dest="progress", action="store_false")


def run_train(args: argparse.Namespace) -> int:
    from engine.train.loop import TrainArgs, train

    fields = TrainArgs.__dataclass_fields__
    out = train(TrainArgs(**{k: v for k, v in vars(args).items() if k in fields}))
    print(f"checkpoints in {out}/best and {out}/last")
    return 0
