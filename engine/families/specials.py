"""Special ids (mask, pad, eos, bos, expand, end-of-turn) found in a checkpoint's own files, never in code.

Where each family keeps them differs (LLaDA's mask is only an added token, Dream's is in
config.json, Open-dCoder's is the tokenizer's mask token), and the ids collide across families, so
every id is looked up in this order: config.json `<kind>_token_id`, tokenizer_config.json
`<kind>_token`, special_tokens_map.json `<kind>_token`, then the family's token names (data in
the registry) among tokenizer.json's added tokens. A name is turned into an id by tokenizer.json
itself (or tokenizer_config.json's `added_tokens_decoder`).

The ids that end a fill besides end-of-text (ModelConfig.eot_token_ids, read through
ModelConfig.end_ids) are config.json's further `eos_token_id`s (a list: chat models) and the family's
end-of-turn names (registry data: LLaDA's `<|eot_id|>`, which its instruct model writes after an
answer and its authors' decoding drops with the other special tokens) that the tokenizer files know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


@dataclass
class TokenFiles:
    """The parsed files of one checkpoint folder that can name special tokens."""

    config: dict
    tokenizer_config: dict
    special_tokens_map: dict
    tokenizer: Tokenizer | None

    @classmethod
    def read(cls, folder: Path, config: dict) -> TokenFiles:
        def js(name: str) -> dict:
            p = folder / name
            if not p.is_file():
                return {}
            try:
                d = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return {}
            return d if isinstance(d, dict) else {}

        tok = Tokenizer.from_file(str(folder / "tokenizer.json")) if (folder / "tokenizer.json").is_file() else None
        return cls(config, js("tokenizer_config.json"), js("special_tokens_map.json"), tok)

    def id_of(self, token: object) -> int | None:
        """Id of a token given by name (or as {"content": name}); None when no file knows it."""
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str) or not token:
            return None
        if self.tokenizer is not None:
            tid = self.tokenizer.token_to_id(token)
            if tid is not None:
                return tid
        for tid, entry in (self.tokenizer_config.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and entry.get("content") == token and str(tid).isdigit():
                return int(tid)
        return None

    def find(self, kind: str, names: tuple[str, ...] = ()) -> tuple[int | None, str]:
        """(id, where it was found) of the `kind` token ("mask", "pad", "eos", "bos", ...)."""
        v = self.config.get(f"{kind}_token_id")
        if isinstance(v, list) and v:  # several eos ids (chat models): the first is the document end
            v = v[0]
        if isinstance(v, int) and not isinstance(v, bool):
            return v, f"config.json {kind}_token_id"
        for fname, d in (
            ("tokenizer_config.json", self.tokenizer_config),
            ("special_tokens_map.json", self.special_tokens_map),
        ):
            tid = self.id_of(d.get(f"{kind}_token"))
            if tid is not None:
                return tid, f"{fname} {kind}_token"
        for name in names:
            tid = self.id_of(name)
            if tid is not None:
                return tid, f"added token {name!r}"
        return None, ""


def special_ids(
    files: TokenFiles,
    mask_names: tuple[str, ...],
    expand_names: tuple[str, ...] = (),
    mask_fallback: int | None = None,
    end_names: tuple[str, ...] = (),
) -> dict:
    """{mask,pad,eos,bos,expand}_token_id and eot_token_ids for ModelConfig, plus `_found` (kind ->
    where) for messages. `mask_fallback`: a family whose authors' code reads the mask id from
    config.json only and otherwise uses this id (WeDLM) - the tokenizer files are then not asked for
    the mask. `end_names`: the family's end-of-turn tokens, ending a fill where the files know them.
    Raises ValueError naming the files when a mask or end-of-text id is nowhere."""
    out, where = {}, {}
    for kind, names in (("mask", mask_names), ("eos", ()), ("pad", ()), ("bos", ()), ("expand", expand_names)):
        if kind == "mask" and mask_fallback is not None:
            v = files.config.get("mask_token_id")
            found = isinstance(v, int) and not isinstance(v, bool)
            out["mask_token_id"] = v if found else mask_fallback
            where["mask"] = (
                "config.json mask_token_id" if found else "the family's authors' default (config.json names none)"
            )
            continue
        tid, src = files.find(kind, names)
        out[f"{kind}_token_id"], where[kind] = tid, src
    if out["mask_token_id"] is None:
        raise ValueError(
            "no mask token: none of config.json mask_token_id, tokenizer_config.json / "
            "special_tokens_map.json mask_token"
            + (f", added tokens {', '.join(mask_names)}" if mask_names else "")
            + " names one"
        )
    if out["eos_token_id"] is None:
        raise ValueError("no end-of-text token in config.json eos_token_id or the tokenizer files")
    if out["pad_token_id"] is None:  # Dream, LLaDA: padding is end-of-text
        out["pad_token_id"], where["pad"] = out["eos_token_id"], "end-of-text (no pad token in the files)"
    out["eot_token_ids"], where["eot"] = end_of_turn_ids(files, end_names, out["eos_token_id"])
    out["_found"] = where
    return out


def end_of_turn_ids(files: TokenFiles, end_names: tuple[str, ...], eos: int) -> tuple[tuple[int, ...], str]:
    """(ids besides `eos` that end a fill, where they were found): config.json's further
    `eos_token_id`s (a list), then the `end_names` the tokenizer files know, in that order, once each."""
    ids: list[int] = []
    where = []
    listed = files.config.get("eos_token_id")
    if isinstance(listed, list):
        more = [t for t in listed[1:] if isinstance(t, int) and not isinstance(t, bool)]
        ids += more
        where += ["config.json eos_token_id"] * bool(more)
    for name in end_names:
        tid = files.id_of(name)
        if tid is not None:
            ids.append(tid)
            where.append(f"added token {name!r}")
    return tuple(dict.fromkeys(t for t in ids if t != eos)), ", ".join(where)
