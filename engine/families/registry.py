"""The open diffusion LM families as data over one architecture (engine/model/transformer.py).

A family is: which config.json it recognises (`architectures` / `model_type`), its layout (config
keys and tensor names: engine/families/layouts.py), its attention topology, whether its logits are
shifted, where its block size lives, the names its mask (and expand) token goes by when config.json
does not give the id, the end-of-turn tokens that end a fill besides end-of-text (`end_names`), and
the `transformers` class it is proven equal to (tests/test_families.py).
Facts and their sources: ../shared/FAMILIES.md and docs/MODELS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.families.layouts import shape_fields
from engine.families.specials import TokenFiles, special_ids
from engine.model.config import ConfigError, ModelConfig


class FamilyError(ConfigError):
    """A checkpoint whose family is unknown or unsupported; the message names what was found."""


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    layout: str  # "qwen2" | "qwen3" | "wedlm" | "llada"
    attention: str  # "bidirectional" | "causal" | "block_causal"
    logits_shift: bool
    hf_class: str  # the transformers class it computes, run with the family's attention
    licence: str
    example: str  # a repo id, for docs and `dlm-lsp models`
    block_key: str | None = None  # config.json key of the block size (block_causal)
    block_default: int = 0
    mask_names: tuple[str, ...] = ()
    expand_names: tuple[str, ...] = ()
    # tokens that end a fill as end-of-text does, where the checkpoint's tokenizer files know them
    # (ModelConfig.eot_token_ids / end_ids): an instruct model's end-of-turn
    end_names: tuple[str, ...] = ()
    needs_mask_token: bool = False  # a generic model type (qwen2) is a diffusion model only with a mask token
    needs_expand_token: bool = False  # DreamOn shares Dream's config: it is told apart by its expand token
    sub_block: int = 0  # Fast-dLLM v2: sub-blocks decoded left to right inside a block (its generate()'s default)
    mask_fallback: int | None = None  # the mask id its authors' code uses when config.json names none
    canvas: str | None = None  # ModelConfig.canvas ("reorder": causal with reordering, engine/decode/reorder.py)
    decodes: bool = True  # False: forward parity only (the engine cannot decode it yet)
    note: str = ""

    def engine_config(self, cfg: dict, files: TokenFiles) -> ModelConfig:
        """ModelConfig for a config.json of this family, special ids from the checkpoint's files."""
        fields = shape_fields(self.layout, cfg)
        try:
            ids = special_ids(files, self.mask_names, self.expand_names, self.mask_fallback, self.end_names)
        except ValueError as e:
            raise FamilyError(f"{self.title}: {e}") from None
        ids.pop("_found")
        block = 0
        if self.attention == "block_causal":
            block = int(cfg.get(self.block_key) or self.block_default)
        mc = ModelConfig(
            **fields,
            attention=self.attention,
            block_size=block,
            logits_shift=self.logits_shift,
            model_type=str(cfg.get("model_type", "")),
            family=self.name,
            sub_block_size=self.sub_block,
            canvas=self.canvas,
            **ids,
        )
        return mc.validate()


FAMILIES: tuple[Family, ...] = (
    # DreamOn first: the same config as Dream, plus an expand token (config.json expand_token_id or the
    # added token <|expand|>); engine/families/dreamon.py decodes its growing and shrinking middle
    Family(
        "dreamon",
        "DreamOn",
        ("DreamModel",),
        ("Dream",),
        "qwen2",
        "bidirectional",
        True,
        "Qwen2ForCausalLM",
        "Apache-2.0",
        "Dream-org/DreamOn-v0-7B",
        mask_names=("<|mask|>",),
        expand_names=("<|expand|>",),
        needs_expand_token=True,
        note="variable-length middle: an expand becomes two masks, an end-of-text inside the middle is deleted",
    ),
    Family(
        "dream",
        "Dream / Dream-Coder / DiffuCoder",
        ("DreamModel",),
        ("Dream",),
        "qwen2",
        "bidirectional",
        True,
        "Qwen2ForCausalLM",
        "Apache-2.0 (Dream, Dream-Coder); Apple sample-code licence, weights apple-amlr (DiffuCoder)",
        "Dream-org/Dream-Coder-v0-Instruct-7B",
        mask_names=("<|mask|>",),
    ),
    Family(
        "llada",
        "LLaDA-8B / LLaDA-1.5",
        ("LLaDAModelLM",),
        ("llada",),
        "llada",
        "bidirectional",
        False,
        "LlamaForCausalLM",
        "MIT",
        "GSAI-ML/LLaDA-8B-Instruct",
        mask_names=("<|mdm_mask|>",),
        # the instruct model ends its answer with <|eot_id|> (126348), then <|endoftext|> padding;
        # its authors' chat.py drops both from the answer (skip_special_tokens)
        end_names=("<|eot_id|>",),
    ),
    Family(
        "coda",
        "CoDA",
        ("CoDALanguageModel",),
        ("CoDA",),
        "qwen3",
        "bidirectional",
        True,
        "Qwen3ForCausalLM",
        "CC BY-NC 4.0 (non-commercial)",
        "Salesforce/CoDA-v0-Instruct",
        mask_names=("<|mask|>",),
        note="CoDA's own code ignores padding: batch rows are compared unpadded",
    ),
    Family(
        "sdar",
        "SDAR / TraDo",
        ("SDARForCausalLM",),
        ("sdar",),
        "qwen3",
        "block_causal",
        False,
        "Qwen3ForCausalLM",
        "MIT (SDAR); see the model card (TraDo)",
        "JetLM/SDAR-1.7B-Chat",
        block_key="block_size",
        block_default=4,
        mask_names=("<|MASK|>", "<|mask|>"),
    ),
    Family(
        "fast-dllm-v2",
        "Fast-dLLM v2",
        ("Fast_dLLM_QwenForCausalLM",),
        ("Fast_dLLM_Qwen",),
        "qwen2",
        "block_causal",
        True,
        "Qwen2ForCausalLM",
        "see the model card",
        "Efficient-Large-Model/Fast_dLLM_v2_7B",
        block_key="bd_size",
        block_default=32,
        mask_names=("|<MASK>|",),
        sub_block=8,
        note="sub-blocks (8) are a decoding schedule, not part of the attention",
    ),
    # WeDLM: causal attention over a reordered canvas (observed first, masks last, logical position
    # ids); its authors' streaming window in engine/families/wedlm.py. Its config.json has
    # "mask_token_id": null and its authors' code then uses 151665 (Tencent/WeDLM
    # wedlm/engine/model_runner.py `_init_mask_token`; finetune/src/trainer.py MASK_TOKEN_ID)
    Family(
        "wedlm",
        "WeDLM",
        ("WeDLMForCausalLM",),
        ("wedlm",),
        "wedlm",
        "causal",
        False,
        "Qwen3ForCausalLM (WeDLM-8B) / Qwen2ForCausalLM (WeDLM-7B)",
        "Apache-2.0",
        "tencent/WeDLM-8B-Instruct",
        mask_fallback=151665,
        canvas="reorder",
        note="streaming window of 16 positions: entropy + position penalty, committed run cached exactly",
    ),
    Family(
        "open-dcoder",
        "Open-dCoder",
        ("Qwen2ForCausalLM",),
        ("qwen2",),
        "qwen2",
        "bidirectional",
        True,
        "Qwen2ForCausalLM",
        "Apache-2.0",
        "fredzzp/open-dcoder-0.5B",
        needs_mask_token=True,
        note="a Qwen2 checkpoint is taken for Open-dCoder only when its tokenizer files name a mask token",
    ),
)


def supported() -> str:
    """One line naming every supported architecture, for error messages."""
    return "; ".join(f"{f.title} ({'/'.join(f.architectures)}, model_type {'/'.join(f.model_types)})" for f in FAMILIES)


def detect(folder: Path, cfg: dict, files: TokenFiles | None = None) -> Family:
    """The family of a checkpoint from its config.json's `architectures` (then `model_type`).
    Raises FamilyError naming what was found and what is supported."""
    archs = cfg.get("architectures") or []
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    mtype = cfg.get("model_type")
    cands = [f for f in FAMILIES if set(archs) & set(f.architectures)]
    cands += [f for f in FAMILIES if mtype in f.model_types and f not in cands]
    for fam in cands:
        if fam.needs_mask_token:
            files = files or TokenFiles.read(folder, cfg)
            if files.find("mask", fam.mask_names)[0] is None:
                continue
        if fam.needs_expand_token:
            files = files or TokenFiles.read(folder, cfg)
            if files.find("expand", fam.expand_names)[0] is None:
                continue
        return fam
    found = f"architectures {archs or 'none'}, model_type {mtype!r}"
    if any(f.needs_mask_token for f in cands):
        raise FamilyError(
            f"{folder}: {found} but no mask token in its tokenizer files: an autoregressive "
            f"checkpoint, not a diffusion model. Supported: {supported()}"
        )
    raise FamilyError(f"{folder}: {found} is not a supported diffusion model family. Supported: {supported()}")
