"""The engine's loops equal the authors' loops around the same logits (issue 37), each checked on a
tiny checkpoint against a transcription of the authors' code at temperature 0:
- LLaDA plans its steps per semi-AR block (engine/decode/canvas.py `block_schedule`, Canvas.plan);
- an instruct LLaDA's <|eot_id|> ends a fill as its end-of-text does (ModelConfig.end_ids);
- Dream's `diffusion_generate` ranks slots by a confidence over the top 50 tokens (DecodeOptions.top_k).
Each transcription is a short function naming the file and function it transcribes; the canvas may
carry a suffix after the masks (the engine's infill), which the authors' loops never unmask."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.api import DecodeOptions
from engine.decode import sampler
from engine.decode.canvas import block_schedule, schedule
from engine.decode.forward import build_canvas
from engine.decode.reference import reference_fill
from engine.decode.sampler import fill
from engine.families.specials import TokenFiles, special_ids
from engine.weights.load import load_checkpoint
from tests.families_tiny import SPECS, seed_of, write_checkpoint

PREFIX, SUFFIX = "def add(a, b):\n    ret", "\n\nfor i in range(10):\n    print(i)\n"
EOT = 126348  # LLaDA-8B-Instruct's <|eot_id|>, an added token of its tokenizer.json


def _exact(**kw) -> DecodeOptions:
    """Options under which the engine's loop is the authors' loop: no cache or window, no padding
    rules, nothing committed early as padding, no healing."""
    base = dict(cache=False, window=0, pad_left=False, heal=False, freeze=False, pad_stop=2.0, confidence="max_prob")
    return DecodeOptions(**{**base, **kw})


# ---------------------------------------------------------------- the authors' loops, transcribed


@torch.no_grad()
def llada_generate(
    model, prompt: list[int], suffix: list[int], gen_length: int, steps: int, block_length: int, mask_id: int
) -> tuple[list[int], list[int]]:
    """ML-GSAI/LLaDA generate.py `generate` (remasking 'low_confidence', temperature 0, cfg_scale 0)
    with its `get_num_transfer_tokens`: the answer is split into gen_length // block_length blocks,
    each decoded with steps // blocks steps; a block's masks are spread over its steps (base, and
    one more in the first `remainder` steps); a step commits the block's masked positions whose
    argmax has the highest probability. Returns the answer's ids and the commits of each step."""
    x = torch.tensor([prompt + [mask_id] * gen_length + suffix])
    P = len(prompt)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    commits = []
    for b in range(num_blocks):
        mask_num = int((x[0, P + b * block_length : P + (b + 1) * block_length] == mask_id).sum())
        num_transfer_tokens = [mask_num // steps + (1 if i < mask_num % steps else 0) for i in range(steps)]
        for i in range(steps):
            mask_index = x == mask_id
            logits = model(x)  # (1, L, V)
            x0 = torch.argmax(logits, dim=-1)
            p = F.softmax(logits, dim=-1)
            x0_p = torch.gather(p, -1, x0[..., None])[..., 0]  # (1, L)
            x0_p[:, P + (b + 1) * block_length :] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, float("-inf"))
            _, select_index = torch.topk(confidence[0], k=num_transfer_tokens[i])
            x[0, select_index] = x0[0, select_index]
            commits.append(num_transfer_tokens[i])
    return x[0, P : P + gen_length].tolist(), commits


def llada_answer(ids: list[int], end_ids: tuple[int, ...]) -> list[int]:
    """What LLaDA's chat.py shows of an instruct answer (`batch_decode(..., skip_special_tokens=True)`):
    the model writes the answer, <|eot_id|>, then <|endoftext|> padding, and the decode drops both
    special tokens: the answer is what comes before the first of them. (The tiny random model writes
    on after its <|eot_id|>; a trained one writes padding there.)"""
    cut = next((i for i, t in enumerate(ids) if t in end_ids), len(ids))
    return ids[:cut]


def dream_top_k_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Dream's generation_utils.py `top_k_logits`: every logit below the k-th best set to the dtype's min."""
    top_k = min(top_k, logits.size(-1))
    indices_to_remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(indices_to_remove, torch.finfo(logits.dtype).min)


def dream_sample_tokens(
    logits: torch.Tensor, top_k: int | None, margin_confidence: bool = False, neg_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's generation_utils.py `sample_tokens` at temperature 0 (no top_p): top-k filter, softmax,
    argmax and its probability; or the top1 - top2 margin; or sum p log(p + 1e-10)."""
    if top_k is not None:
        logits = dream_top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


@torch.no_grad()
def dream_diffusion_generate(
    model,
    prompt: list[int],
    suffix: list[int],
    gen_length: int,
    steps: int,
    mask_id: int,
    alg: str,
    top_k: int | None,
    eps: float = 1e-3,
) -> tuple[list[int], list[list[int]]]:
    """Dream's generation_utils.py `DreamGenerationMixin._sample` (alg maskgit_plus / topk_margin /
    entropy, temperature 0, alg_temp None), as `diffusion_generate` runs it: logits shifted right by
    one; with timesteps linspace(1, eps, steps + 1) step i commits int(m * (1 - s / t)) of the m masks
    (all at the last step), those of highest confidence from `sample_tokens` with `top_k`. Returns
    the answer's ids and the positions (in the answer) each step committed."""
    x = torch.tensor([prompt + [mask_id] * gen_length + suffix])
    timesteps = torch.linspace(1, eps, steps + 1)
    order = []
    for i in range(steps):
        mask_index = x == mask_id
        logits = model(x)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]  # (M, V)
        t, s = timesteps[i], timesteps[i + 1]
        confidence, x0 = dream_sample_tokens(mask_logits, top_k, alg == "topk_margin", alg == "entropy")
        num_mask_token = mask_index.sum()
        number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        if number_transfer_tokens > 0:
            _, transfer_index = torch.topk(confidence, number_transfer_tokens)
            x0_ = torch.zeros_like(x0) + mask_id
            x0_[transfer_index] = x0[transfer_index].clone()
            order.append(sorted(int(torch.nonzero(mask_index[0])[j]) - len(prompt) for j in transfer_index))
            x[mask_index] = x0_
    return x[0, len(prompt) : len(prompt) + gen_length].tolist(), order


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def llada(family_folders):
    return load_checkpoint(family_folders["llada"])


@pytest.fixture(scope="module")
def dream(family_folders):
    return load_checkpoint(family_folders["dream"])


@pytest.fixture(scope="module")
def llada_instruct(tmp_path_factory):
    """The tiny LLaDA (same weights) with LLaDA-8B-Instruct's <|eot_id|> among its added tokens, its
    head steered so that the answer ends: the <|eot_id|> row is 1.02 x the row of a token the
    unsteered model writes mid-answer, so wherever that token would win, the end of turn does."""
    spec = dataclasses.replace(SPECS["llada"], specials={**SPECS["llada"].specials, "<|eot_id|>": EOT})
    model, tok, cfg = load_checkpoint(
        write_checkpoint(spec, tmp_path_factory.mktemp("llada-instruct"), seed_of("llada"))
    )
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    unsteered, _ = llada_generate(model, prefix, suffix, 16, 8, 16, cfg.mask_token_id)
    with torch.no_grad():
        model.head_weight[EOT] = 1.02 * model.head_weight[unsteered[10]]
    return model, tok, cfg


# ---------------------------------------------------------------- 1. LLaDA's plan per block


def test_block_schedule_plans_each_block_as_llada_does():
    assert block_schedule(16, 6, 8) == [3, 3, 2, 3, 3, 2]  # LLaDA: get_num_transfer_tokens(8 masks, 3 steps) x 2
    assert schedule(16, 6) == [3, 3, 3, 3, 2, 2]  # one plan over every slot: not LLaDA's with blocks
    assert block_schedule(16, 6, 0) == schedule(16, 6) and block_schedule(16, 6, 16) == schedule(16, 6)
    assert block_schedule(16, 16, 8) == [1] * 16 and block_schedule(16, 4, 4) == [4, 4, 4, 4]
    # where LLaDA asserts: a shorter last block over the same steps per block; left-over steps unused
    assert block_schedule(12, 6, 8) == [3, 3, 2, 2, 1, 1]
    assert block_schedule(16, 7, 8) == [3, 3, 2, 3, 3, 2]
    assert block_schedule(7, 3, 2) == [2, 2, 2, 1]  # 4 blocks, 3 steps: at least one step a block
    for n in range(1, 20):
        for steps in range(1, 20):
            for block in range(0, 9):
                assert sum(block_schedule(n, steps, block)) == n and min(block_schedule(n, steps, block)) >= 1


@pytest.mark.parametrize("with_suffix", [False, True], ids=["prompt-only", "infill"])
@pytest.mark.parametrize(
    "steps,block", [(6, 8), (8, 8), (16, 8), (12, 4), (4, 4), (6, 0), (16, 0), (6, 16)], ids=lambda v: str(v)
)
def test_llada_fill_equals_llada_generate(llada, with_suffix, steps, block):
    """16 slots, LLaDA's `generate` with block_length = the engine's block (0: one block of 16):
    the same ids and the same commits at each step (6 steps, blocks of 8: [3, 3, 2, 3, 3, 2])."""
    model, tok, cfg = llada
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX) if with_suffix else []
    c = build_canvas(prefix, suffix, 16, cfg, _exact(selection="topk", steps=steps, block=block))
    r = fill(model, c)
    want, commits = llada_generate(model, prefix, suffix, 16, steps, block or 16, cfg.mask_token_id)
    assert c.slot_ids() == want
    assert r.tokens_per_step == commits and r.steps == steps
    if (steps, block) == (6, 8):
        assert r.tokens_per_step == [3, 3, 2, 3, 3, 2]


def test_llada_blocks_on_a_slot_count_not_a_multiple_of_the_block(llada):
    """12 slots in blocks of 8 (LLaDA asserts a multiple): the last block of 4 is planned over the same
    3 steps per block, and each step commits only inside the leftmost block with masks."""
    model, tok, cfg = llada
    c = build_canvas(tok.encode(PREFIX), tok.encode(SUFFIX), 12, cfg, _exact(selection="topk", steps=6, block=8))
    assert c.plan == [3, 3, 2, 2, 1, 1]
    blocks = []
    while not c.done:
        before = c.masked.clone()
        sampler.step(model, [c])
        blocks.append({int(j) // 8 for j in torch.nonzero(before & ~c.masked).flatten()})
    assert c.tokens_per_step == [3, 3, 2, 2, 1, 1] and blocks == [{0}] * 3 + [{1}] * 3


# ---------------------------------------------------------------- 2. an instruct LLaDA's end of turn


def test_llada_end_ids_come_from_its_files(llada, llada_instruct):
    assert llada[2].end_ids == (126081,) and llada[2].eot_token_ids == ()  # the base tokenizer: no <|eot_id|>
    cfg = llada_instruct[2]
    assert cfg.eos_token_id == 126081 and cfg.eot_token_ids == (EOT,) and cfg.end_ids == (126081, EOT)


def test_further_config_json_eos_ids_are_end_ids():
    files = TokenFiles({"mask_token_id": 5, "eos_token_id": [1, 7, 1, 9]}, {}, {}, None)
    ids = special_ids(files, ())
    assert ids["eos_token_id"] == 1 and ids["eot_token_ids"] == (7, 9)


@pytest.mark.parametrize("steps,block", [(8, 0), (16, 0), (6, 8), (8, 8), (16, 8)], ids=lambda v: str(v))
def test_instruct_llada_fill_ends_at_its_eot_as_its_answer_does(llada_instruct, steps, block):
    """The steered instruct model writes <|eot_id|> mid-answer: the engine's fill is LLaDA's answer
    (its `generate`, then what chat.py shows), blocks or not; the fill never holds the end of turn."""
    model, tok, cfg = llada_instruct
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    c = build_canvas(prefix, suffix, 16, cfg, _exact(selection="topk", steps=steps, block=block))
    r = fill(model, c)
    want, _ = llada_generate(model, prefix, suffix, 16, steps, block or 16, cfg.mask_token_id)
    answer = llada_answer(want, cfg.end_ids)
    assert EOT in want and want.index(EOT) == len(answer) >= 4  # the answer ends at its end of turn
    assert r.ids == answer and EOT not in r.ids
    if not block:  # without the block rule nothing is cut early: the canvases are equal too
        assert c.slot_ids() == want


def test_eot_ends_fills_under_the_servers_options_and_only_as_an_end_id(llada_instruct):
    model, tok, cfg = llada_instruct
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    for opts in (DecodeOptions(heal=False), DecodeOptions(selection="topk", heal=False, block=8)):
        assert EOT not in fill(model, build_canvas(prefix, suffix, 16, cfg, opts)).ids
    # the guard: the same model without the end id writes the <|eot_id|> into its fill as a token
    plain = dataclasses.replace(cfg, eot_token_ids=())
    assert EOT in fill(model, build_canvas(prefix, suffix, 16, plain, _exact(selection="topk", steps=8))).ids


# ---------------------------------------------------------------- 3. Dream's confidence over the top 50


@pytest.mark.parametrize("with_suffix", [False, True], ids=["prompt-only", "infill"])
@pytest.mark.parametrize("steps", [6, 16])
@pytest.mark.parametrize(
    "alg,confidence", [("maskgit_plus", "max_prob"), ("entropy", "neg_entropy"), ("topk_margin", "margin")]
)
def test_dream_fill_with_top_k_equals_diffusion_generate(dream, with_suffix, steps, alg, confidence):
    """`selection="timesteps", top_k=50` is Dream's `diffusion_generate` as its README calls it."""
    model, tok, cfg = dream
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX) if with_suffix else []
    c = build_canvas(
        prefix, suffix, 16, cfg, _exact(selection="timesteps", steps=steps, confidence=confidence, top_k=50)
    )
    order = []
    while not c.done:
        before = c.masked.clone()
        sampler.step(model, [c])
        order.append(torch.nonzero(before & ~c.masked).flatten().tolist())
    want, want_order = dream_diffusion_generate(model, prefix, suffix, 16, steps, cfg.mask_token_id, alg, 50)
    assert c.slot_ids() == want and order == want_order


@pytest.mark.parametrize("alg", ["maskgit_plus", "entropy"])
def test_top_k_changes_dreams_commit_order(dream, alg):
    """Guards the test above: on its inputs the top-50 confidence commits in another order (and
    writes other tokens) than the full-vocabulary one."""
    model, tok, cfg = dream
    prefix = tok.encode(PREFIX)
    for steps in (6, 16):
        full = dream_diffusion_generate(model, prefix, [], 16, steps, cfg.mask_token_id, alg, None)
        top50 = dream_diffusion_generate(model, prefix, [], 16, steps, cfg.mask_token_id, alg, 50)
        assert full[1] != top50[1] and full[0] != top50[0]


def test_top_k_takes_the_full_row_path(dream, monkeypatch):
    """The fused slot statistics have no top-k: with top_k set the sampler never calls them."""
    model, tok, cfg = dream

    def fused(*a, **k):
        raise AssertionError("slot_stats called with top_k set")

    monkeypatch.setattr(sampler, "slot_stats", fused)
    r = fill(model, build_canvas(tok.encode(PREFIX), tok.encode(SUFFIX), 8, cfg, DecodeOptions(top_k=50)))
    assert r.steps >= 1
    with pytest.raises(AssertionError, match="slot_stats"):
        fill(model, build_canvas(tok.encode(PREFIX), tok.encode(SUFFIX), 8, cfg, DecodeOptions(heal=False)))


@pytest.mark.parametrize(
    "opts",
    [
        DecodeOptions(threshold=0.05, top_k=50, cache=False, window=0, heal=False),
        DecodeOptions(selection="topk", steps=4, block=4, top_k=5, cache=False, window=0, heal=False),
        DecodeOptions(threshold=0.2, confidence="margin", top_k=3, cache=True, refresh_every=1, heal=False),
    ],
    ids=["threshold-k50", "topk-blocks-k5", "margin-k3-cache"],
)
def test_top_k_fast_loop_equals_the_oracle(dream, opts):
    model, tok, cfg = dream
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    assert fill(model, build_canvas(prefix, suffix, 8, cfg, opts)).ids == reference_fill(model, prefix, suffix, 8, opts)


def test_top_k_with_a_healed_slot_keeps_its_candidates(dream):
    """A healed slot with fewer candidates than k keeps them all (no row is emptied), and the fast
    loop equals the oracle."""
    model, tok, cfg = dream
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    heal = sorted(set(tok.encode("return a + b")))[:3]
    opts = DecodeOptions(threshold=0.3, top_k=50, cache=False, window=0)
    got = fill(model, build_canvas(prefix, suffix, 6, cfg, opts, heal=heal)).ids
    assert got == reference_fill(model, prefix, suffix, 6, opts, heal=heal) and got[0] in heal


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_top_k_must_be_a_positive_integer(dream, bad):
    _, tok, cfg = dream
    with pytest.raises(ValueError, match="top_k"):
        build_canvas(tok.encode(PREFIX), [], 4, cfg, DecodeOptions(top_k=bad))
