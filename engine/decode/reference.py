"""The naive oracle the fast loop is tested against token for token: full recompute every step, full
softmax in fp64, plain Python selection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.api import DecodeOptions
from engine.bias.copy import Run, copy_bias, ngram_skip
from engine.decode.canvas import block_schedule, timestep_schedule, trim_fill
from engine.decode.forward import build_canvas
from engine.decode.reorder import reference_logits

if TYPE_CHECKING:
    from engine.bias.names import NameBias
    from engine.bias.ngram import NgramTable
    from engine.model.transformer import Transformer

Candidate = tuple[int, int, float, bool]  # (slot, token, confidence, confident padding)


@torch.no_grad()
def reference_fill(
    model: Transformer,
    prefix: list[int],
    suffix: list[int],
    n: int,
    opts: DecodeOptions,
    context_tokens: int = 512,
    heal: list[int] | None = None,
    heal_then: dict[int, list[int]] | None = None,
    lookup: list[int] | None = None,
    stop_ids: list[int] | None = None,
    names: NameBias | None = None,
    ngram: NgramTable | None = None,
    workspace: list[list[int]] | None = None,
) -> list[int]:
    """Naive sampler kept as the oracle: full recompute every step, full softmax over the vocabulary
    in fp64, plain Python selection. Temperature 0 only. Returns the fill's token ids. `heal`,
    `heal_then`: token healing, as in Canvas.build; `lookup`: the copy boost's far side (ids); `stop_ids`: Canvas.stop_ids;
    `names`: Canvas.names (engine.bias.names.NameBias); `ngram`: Canvas.ngram (engine.bias.ngram.NgramTable);
    `workspace`: the workspace's files as id lists, the filled one left out (DecodeOptions.workspace_ngram)."""
    assert opts.temperature == 0, "the oracle is deterministic"
    cfg = model.cfg
    c = build_canvas(prefix, suffix, n, cfg, opts, context_tokens, heal=heal, heal_then=heal_then)  # the same cut
    c.attach_far(lookup)
    c_prefix, c_suffix = c.ids[: c.start].tolist(), c.ids[c.start + c.n :].tolist()
    lookup = (lookup or [])[-16384:]  # far_ids keeps as much
    c.stop_ids = tuple(stop_ids or ())
    ends = (cfg.pad_token_id, *cfg.end_ids) + c.stop_ids
    assert c.middle is None, "DreamOn's growing middle has its own oracle (tests/test_families_decode.py)"
    then = dict(heal_then or {})
    h_slot, h_ids = (0, set(heal)) if heal else (None, set())
    seq, s = c.ids.tolist(), c.start
    masked = list(range(n))
    plan = {
        "topk": lambda: block_schedule(n, opts.steps or max(1, n // 2), opts.block),
        "timesteps": lambda: timestep_schedule(n, opts.steps or n),
    }.get(opts.selection, list)()
    shift = 1 if cfg.logits_shift else 0
    steps = 0
    groups: list[list[int]] = []  # slots committed at each step (the reorder layout's cache order)
    while masked:
        ends_now = ends if h_slot is None else (cfg.pad_token_id, *cfg.end_ids)  # no stop while healing
        if cfg.canvas == "reorder":  # the whole reordered row, recomputed, its logits in logical order
            logits = reference_logits(model, seq, s, n, groups).double()
        else:
            logits = model(torch.tensor([seq]))[0].double()  # (L, V)
        if c.copy is not None:  # the context copy boost, from each masked slot's left neighbour now
            left: list[Run] = []
            for j in masked:  # the committed run just left of slot j, written out plainly
                run: list[int] = []
                q = s + j - 1
                while q >= 0 and len(run) < max(1, opts.copy_order or 1) and seq[q] != cfg.mask_token_id:
                    run.insert(0, seq[q])
                    q -= 1
                left.append(tuple(run))
            budget_now = opts.selection == "threshold" and opts.steps is not None and steps + 1 >= opts.steps
            if opts.copy_chain and c.middle is None and cfg.family != "wedlm":
                # draft chaining: slot j - 1 masked too -> its biased, restricted argmax continues j's run
                bias = torch.zeros(len(masked), logits.shape[-1], dtype=torch.float64)
                runs: list[Run] = []
                for r, j in enumerate(masked):
                    chained = left[r]
                    if r > 0 and masked[r - 1] == j - 1:
                        row = logits[s + j - 1 - shift] + bias[r - 1]
                        row[cfg.mask_token_id] = float("-inf")
                        if h_slot is not None and j - 1 == h_slot:
                            allowed = sorted(h_ids - set(then) if budget_now and h_slot == 0 else h_ids)
                            row = torch.where(
                                torch.isin(torch.arange(row.shape[0]), torch.tensor(allowed)),
                                row,
                                torch.full_like(row, float("-inf")),
                            )
                        chained = (runs[r - 1] + (int(torch.argmax(row)),))[-max(1, opts.copy_order or 1) :]
                    runs.append(chained)
                    bias[r] = copy_bias(
                        [chained], *c.copy, logits.shape[-1], opts, dtype=torch.float64, far=c.copy_far
                    )[0]
            else:
                bias = copy_bias(left, *c.copy, logits.shape[-1], opts, dtype=torch.float64, far=c.copy_far)
            for r, j in enumerate(masked):
                logits[s + j - shift] += bias[r]
        if ngram is not None and opts.ngram:  # the corpus n-gram memory, from each masked slot's committed left run
            for j in masked:
                run, q = [], s + j - 1
                while q >= 0 and len(run) < max(ngram.orders) and seq[q] != cfg.mask_token_id:
                    run.insert(0, seq[q])
                    q -= 1
                hit = ngram.next_probs(tuple(run)) if run and not set(run) & set(ngram_skip(cfg)) else None
                for t, p in zip(*hit) if hit is not None else ():  # the longest stored context's next ids
                    logits[s + j - shift, int(t)] += opts.ngram * float(p)
        if opts.local_ngram or (opts.workspace_ngram and workspace is not None):
            # the fill's own n-gram: count the contexts in the lookup and the context, plainly; where
            # none is followed often enough, the same over the workspace's files
            texts = [[-1 if t in ngram_skip(cfg) else t for t in x] for x in (lookup or [], c_prefix, c_suffix)]
            sources = ([(texts, opts.local_ngram)] if opts.local_ngram else []) + (
                [(workspace, opts.workspace_ngram)] if opts.workspace_ngram and workspace is not None else []
            )
            for j in masked:
                run, q = [], s + j - 1
                while q >= 0 and len(run) < 6 and seq[q] != cfg.mask_token_id:
                    run.insert(0, seq[q])
                    q -= 1
                if not run or set(run) & set(ngram_skip(cfg)):
                    continue
                for src, weight in sources:
                    found = False
                    for k in (6, 5, 4, 3):  # the longest context followed at least twice
                        if k > len(run):
                            continue
                        nexts = [
                            x[i + k]
                            for x in src
                            for i in range(len(x) - k)
                            if x[i + k] >= 0 and tuple(x[i : i + k]) == tuple(run[-k:])
                        ]
                        if len(nexts) >= 2:
                            top_next = sorted(set(nexts), key=lambda t: (-nexts.count(t), t))[:2]
                            for t in top_next:
                                logits[s + j - shift, t] += weight * nexts.count(t) / len(nexts)
                            found = True
                            break
                    if found:
                        break
        budget_out = opts.selection == "threshold" and opts.steps is not None and steps + 1 >= opts.steps
        if names is not None:  # identifier-aware decoding: the leftmost masked slot, all left of it committed
            j0 = masked[0]
            done = seq[s : s + j0]
            if not any(t in (cfg.pad_token_id, *cfg.end_ids) for t in done):
                cands = None
                if h_slot is not None and j0 == h_slot:
                    cands = sorted(h_ids - set(then) if budget_out and h_slot == 0 else h_ids)
                penalty = names.slot_row(done, cands)
                if penalty is not None:
                    logits[s + j0 - shift] += penalty.double()
        logits[:, cfg.mask_token_id] = float("-inf")
        if h_slot is not None:  # the healed slot: only its candidates (a last step at slot 0: whole ones)
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
            keep[sorted(h_ids - set(then) if budget_out and h_slot == 0 else h_ids)] = True
            logits[s + h_slot - shift, ~keep] = float("-inf")
        if opts.top_k is not None:  # every row cut to its k best tokens (ties with the k-th kept)
            kth = torch.topk(logits, min(opts.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits[logits < kth] = float("-inf")
        probs = F.softmax(logits, dim=-1)
        cand: list[Candidate] = []
        max_p: dict[int, float] = {}
        for j in masked:
            p = probs[s + j - shift]
            top = torch.topk(p, 2)
            tok = int(torch.argmax(p))
            mp, t2 = float(p[tok]), float(top.values[1])
            ent = float(-(p[p > 0] * p[p > 0].log()).sum())
            conf = {"max_prob": mp, "margin": mp - t2, "neg_entropy": -ent}[opts.confidence]
            is_pad = tok in ends_now
            cand.append((j, tok, conf, is_pad and mp >= opts.pad_stop))
            max_p[j] = mp
        if opts.window > 0 and not budget_out:  # only the leftmost `window` masked slots are predicted
            cand = cand[: opts.window]
        if budget_out or all(x[3] for x in cand):
            chosen = cand
        else:
            if opts.block > 0:  # only the leftmost block that still has masks
                lo = min(masked) // opts.block * opts.block
                cand_e = [x for x in cand if lo <= x[0] < lo + opts.block]
            else:
                cand_e = cand
            if opts.pad_left:  # padding only at the leftmost masked slot
                first = min(masked)
                cand_e = [x for x in cand_e if x[0] == first or x[1] not in ends_now] or [
                    x for x in cand if x[0] == first
                ]
            if h_slot == 0 and then:  # slot 1 waits while slot 0 may take a piece of the tail
                cand_e = [x for x in cand_e if x[0] != 1]
            if cfg.block_size:  # block-causal: only the leftmost absolute block (sub-block) that has masks
                unit = (
                    cfg.sub_block_size
                    if cfg.sub_block_size and cfg.block_size % cfg.sub_block_size == 0
                    else cfg.block_size
                )
                lead = [x for x in cand if x[0] == min(masked)]
                if cfg.logits_shift and (s + min(masked)) % cfg.block_size == 0:  # predicted from the block before
                    cand_e = lead
                blk = (s + min(masked)) // unit
                cand_e = [x for x in cand_e if (s + x[0]) // unit == blk] or lead
            ranked = sorted(cand_e, key=lambda x: (-x[2], x[0]))
            if opts.selection in ("topk", "timesteps"):
                chosen = ranked[: plan.pop(0) if plan else 1]
            else:
                chosen = [x for x in cand_e if x[2] >= opts.threshold] or ranked[:1]
                first = min(masked)
                if (
                    opts.stop_below
                    and cfg.family != "wedlm"
                    and h_slot is None
                    and cand_e
                    and cand_e[0][0] == first
                    and not any(x[2] >= opts.threshold for x in cand_e)
                    and max_p[first] < opts.stop_below
                ):
                    chosen = [(first, cfg.eos_token_id, 0, False)]  # stop when unsure: the end, at the leftmost slot
        if opts.block > 0 or opts.pad_left or opts.window > 0:  # a committed padding/end slot ends the fill
            ends_at = [x[0] for x in chosen if x[1] in ends_now]
            if ends_at:
                cut = min(ends_at)
                chosen = (
                    [x for x in chosen if x[0] < cut]
                    + [
                        (
                            cut,
                            cfg.eos_token_id if opts.pad_left else next(x[1] for x in chosen if x[0] == cut),
                            0,
                            False,
                        )
                    ]
                    + [(j, cfg.pad_token_id, 0, False) for j in masked if j > cut]
                )
        for j, tok, _, _ in chosen:
            seq[s + j] = tok
            masked.remove(j)
            if j == h_slot:
                if j == 0 and tok in then and not budget_out:
                    h_slot, h_ids = 1, set(then[tok])
                else:
                    h_slot = None
        groups.append(sorted(x[0] for x in chosen))
        steps += 1
    return trim_fill(seq[s : s + n], cfg.pad_token_id, cfg.end_ids)
