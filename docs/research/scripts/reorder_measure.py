# Research probe, kept as it ran at commit 9f08cf2; not maintained: it may not run against today's layout.
"""The two measurements docs/MODEL.md quotes for recipe (c) (engine/decode/reorder.py), one thread each:

    .venv/bin/python docs/research/scripts/reorder_measure.py train   # CPU time per training step: (a) vs (c), +- the AR loss
    .venv/bin/python docs/research/scripts/reorder_measure.py reuse   # per-keystroke context reuse vs full recompute
    .venv/bin/python docs/research/scripts/reorder_measure.py checkpoint runs/random/reorder-4m  # for bench --incremental

`train` times train.loss_on + backward + AdamW on 10 batches (8 x 512, the 4 M shape, 150 stdlib files,
the shipped tokenizer) by process CPU time, so a shared machine inflates it less than wall time.
`reuse` types one token per keystroke into a 440-token prefix (+ 40 suffix tokens, 16 slots, 4 top-k
steps) on a random-weight 4 M-shaped reorder model and prints p50 first-step and fill times.
`checkpoint DIR` writes that model (models/default's config with causal attention and the reorder
canvas, its tokenizer, init_weights(0)) as a checkpoint, for `dlm-lsp bench --incremental --model DIR`;
write it under runs/ (ignored by git).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.api import DecodeOptions  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.transformer import Transformer  # noqa: E402


def train_steps() -> None:
    from engine.train import corpus
    from engine.tokenizer import EOS, MASK, PAD, TextTokenizer
    from engine.train.loop import Batches, TrainArgs, loss_on

    tok = TextTokenizer.load("models/default")
    texts = [t for t in (f.read() for f in corpus.collect([], include_stdlib=True)[:150]) if t]
    for name, kw in (("diffusion --holes 4", dict(objective="diffusion", holes=4)),
                     ("reorder --holes 4", dict(objective="reorder", holes=4)),
                     ("reorder --holes 4 --reorder-ar 0.5", dict(objective="reorder", holes=4, reorder_ar=0.5))):
        a = TrainArgs(**kw)
        reorder = a.objective == "reorder"
        cfg = ModelConfig(vocab_size=tok.vocab_size, dim=192, n_layers=5, n_heads=4, ffn_dim=576, max_seq_len=1024,
                          context_len=512, attention="causal" if reorder else "bidirectional",
                          canvas="reorder" if reorder else None, mask_token_id=tok.token_id(MASK),
                          pad_token_id=tok.token_id(PAD), eos_token_id=tok.token_id(EOS)).validate()
        model = Transformer(cfg)
        model.init_weights(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        data = Batches(texts, tok, a, seed=0)
        batches = [data.batch(8) for _ in range(12)]
        off = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
        c0, toks, tgts = 0.0, 0, 0
        for i, b in enumerate(batches):
            if i == 2:  # two warm-up steps
                c0 = time.process_time()
            loss_on(model, b, "cpu", off).backward()
            opt.step()
            opt.zero_grad()
            if i >= 2:
                toks += int(b["key_valid"].sum())
                tgts += int((b["targets"] >= 0).sum())
        dt = time.process_time() - c0
        print(f"{name:36s} {dt / 10 * 1000:6.0f} ms CPU/step  {toks / dt:6.0f} tokens/CPU-s  "
              f"loss rows/token {tgts / toks:.3f}", flush=True)


def reuse() -> None:
    from engine.decode.reorder import SessionCache

    from engine.decode.sampler import fill
    from engine.decode.forward import build_canvas
    cfg = ModelConfig(vocab_size=8192, dim=192, n_layers=5, n_heads=4, ffn_dim=576, max_seq_len=1024, context_len=512,
                      attention="causal", canvas="reorder", mask_token_id=2, pad_token_id=0, eos_token_id=1).validate()
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    doc = torch.randint(10, 8192, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    suffix, o = doc[560:600], DecodeOptions(selection="topk", steps=4, pad_stop=2.0)

    def run(with_reuse: bool):
        sessions, fills, firsts, ids = SessionCache(), [], [], []
        for k in range(24):
            c = build_canvas(doc[: 440 + k], suffix, 16, cfg, o)
            if with_reuse:
                c.session, c.session_key = sessions, "doc"
            t0 = time.perf_counter()
            r = fill(model, c)
            fills.append((time.perf_counter() - t0) * 1000)
            firsts.append(r.ms_per_step[0])
            ids.append(r.ids)
        return fills[4:], firsts[4:], ids

    run(False)
    full, reused = run(False), run(True)
    for name, (fills, firsts, _) in (("full recompute", full), ("reuse", reused)):
        print(f"{name:15s} first step p50 {statistics.median(firsts):6.1f} ms   fill p50 {statistics.median(fills):6.1f} ms")
    print("identical fills:", full[2] == reused[2])


def checkpoint(folder: str) -> None:
    import json

    from engine.weights.checkpoint import save_checkpoint
    from engine.tokenizer import TextTokenizer

    cfg = ModelConfig.from_dict({**json.loads(Path("models/default/config.json").read_text()),
                                 "attention": "causal", "canvas": "reorder"}).validate()
    model = Transformer(cfg)
    model.init_weights(0)
    save_checkpoint(folder, model, TextTokenizer.load("models/default"))
    print(f"wrote {folder}: random weights, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params (timing only)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) > 1 and sys.argv[1] == "checkpoint":
        checkpoint(sys.argv[2])
    else:
        {"train": train_steps, "reuse": reuse}[sys.argv[1] if len(sys.argv) > 1 else "reuse"]()
