"""Which masked slots a block-causal family may commit at a step: its authors' block-by-block order.

Both block-causal families decode blocks (absolute positions // block_size, aligned to 0) left to
right, and commit only inside the leftmost block that still has masks:

- SDAR / TraDo (JetAstra/SDAR `generate.py`, `block_diffusion_generate`): the whole block is one
  unit; its steps commit by confidence among the block's masks (`low_confidence_dynamic`: every
  mask above the threshold, else the most confident).
- Fast-dLLM v2 (its `generate()`): the block is split into sub-blocks (`small_block_size`, 8 by
  default) decoded left to right, each step committing the sub-block's masks whose probability
  exceeds the threshold, and at least its most probable one. Its logits are shifted, so a block's
  first position is predicted from the last position of the block before, which that block cannot
  see: the authors commit it autoregressively, alone, as soon as the block before is complete
  (`next_token = logits[:, -1:].argmax()`), before any mask of the new block.

The rule is data: `ModelConfig.block_size`, `sub_block_size` (from the family registry) and
`logits_shift`. tests/test_families_decode.py re-implements both authors' loops as oracles.
"""

from __future__ import annotations

from engine.model.config import ModelConfig


def block_eligible(cfg: ModelConfig, start: int, slots: list[int], elig: list[int]) -> list[int]:
    """The indices of `elig` (indices into `slots`, the masked slot numbers in ascending order)
    that the family's block order allows this step; never empty (falls back to the leftmost mask).
    `start` is the canvas position of slot 0."""
    bs = cfg.block_size
    first = start + slots[0]  # the leftmost masked position: its block (and sub-block) is the current one
    unit = bs
    sub = getattr(cfg, "sub_block_size", 0)
    if sub and bs % sub == 0:
        unit = sub
    if cfg.logits_shift and first % bs == 0:
        return [0]  # a block's first position: predicted from the block before, committed alone (AR)
    cur = first // unit
    out = [i for i in elig if (start + slots[i]) // unit == cur]
    return out or [0]
