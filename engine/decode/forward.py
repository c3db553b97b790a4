"""The batched forward: the only module that knows every canvas layout. `build_canvas` builds the
canvas a model's layout needs; `forward` runs a batch of canvases through the model - the reorder
layout's own forward, a first forward against a reuse session, full forwards, one cached step -
and gives each canvas its rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from engine.api import DecodeOptions
from engine.decode import reorder, reuse
from engine.decode.cache import BatchContext, Rows, forward_cached, forward_full
from engine.decode.canvas import Canvas
from engine.decode.reorder import ReorderCanvas
from engine.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from engine.model.transformer import Transformer


def build_canvas(
    prefix: list[int],
    suffix: list[int],
    n: int,
    cfg: ModelConfig,
    opts: DecodeOptions,
    context_tokens: int = 512,
    device: str | torch.device = "cpu",
    heal: list[int] | None = None,
    heal_then: dict[int, list[int]] | None = None,
) -> Canvas:
    """The canvas for this model's layout (Canvas.build's arguments): recipe (c)'s and WeDLM's
    reordered one (engine/decode/reorder.py) for `canvas: "reorder"` models, else the plain one."""
    kind = ReorderCanvas if cfg.canvas == "reorder" else Canvas
    return kind.build(prefix, suffix, n, cfg, opts, context_tokens, device, heal, heal_then)


def forward(model: Transformer, canvases: list[Canvas], batch_ctx: BatchContext | None = None) -> list[Rows]:
    """Hidden states for a batch: one full forward for the canvases that need one, one cached step
    for the rest. Returns per canvas (hidden (R, D), their positions (R,)), in order."""
    if canvases and canvases[0].cfg.canvas == "reorder":  # causal, masks last: engine/decode/reorder.py
        # build_canvas gives a "reorder" model's canvases their own class (one model per batch)
        return reorder.forward(model, cast(list[ReorderCanvas], canvases), batch_ctx)
    full = [c for c in canvases if c.needs_full()]
    cached = [c for c in canvases if not c.needs_full()]
    hs: dict[int, Rows] = {}
    keyed = [c for c in full if c.reuse is not None and c.kv is None]  # a first forward with a session
    if keyed:  # each against its own session's K/V: on a GPU the reusing ones in one forward
        if keyed[0].ids.is_cuda:
            hs.update(zip(map(id, keyed), reuse.forward_first_batch(model, keyed)))
        else:  # compute-bound on a CPU, as full forwards below
            for c in keyed:
                hs[id(c)] = reuse.forward_first(model, c)
        full = [c for c in full if id(c) not in hs]
    if full and full[0].ids.is_cuda:
        hs.update(zip(map(id, full), forward_full(model, full)))
    else:
        # a full forward is compute-bound on a CPU: batching saves nothing there and padding costs
        for c in full:
            hs[id(c)] = forward_full(model, [c])[0]
    if cached:
        hs.update(zip(map(id, cached), forward_cached(model, cached, batch_ctx)))
    return [hs[id(c)] for c in canvases]
