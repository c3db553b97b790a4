"""Byte-level BPE tokenizer (tokenizer.json via `tokenizers`) with the special ids the engine needs.

Beyond encode and decode, two things a cursor asks of it:
- Token healing (`heal`). The cursor cuts text where training text was rarely cut, so the prefix
  ends in tokens the model seldom saw there (`impo|` is `imp` `o` where text had `import`; the
  indentation `\\n        ` where text had `\\n       ` + ` self`). `heal` chooses the prefix tail a
  fill re-types: the last k (<= 3) tokens, k the longest whose text a vocabulary token extends, with
  the ids slot 0 may take (those that extend the tail's text, or a shorter piece of it) and, for a
  piece, the ids slot 1 may then take (`Healing`). engine/decode/canvas.py enforces it; the fill's
  text leaves the re-typed tail out.
- Re-tokenizing only what changed (`encode_edit`). A keystroke changes one line of a prefix of
  thousands of tokens. `encode_edit` keeps the earlier ids up to the last indent character (or
  blank line's break) before the first change, a place where the GPT-2 byte-level pre-tokenizer
  always ends a piece, and tokenizes from there on: the same ids as tokenizing the whole text
  (tests/test_tokenizer_edit.py). The service (`EngineService._encode`) uses it for the prefix and
  suffix of every job with a session key (FillJob.session, the server's document), so a keystroke
  tokenizes its line, not the file. `encode_lines` does the like for far text: it tokenizes by
  pieces and keeps each piece's ids across keystrokes.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Names of the special tokens in tokenizers this project trains. Their ids are whatever the trained
# tokenizer assigns; the engine reads them from config.json, never from here.
PAD, EOS, MASK, BOS = "<|pad|>", "<|endoftext|>", "<|mask|>", "<|bos|>"
# fill-in-the-middle markers for the autoregressive twin (the diffusion model infills literally)
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
SPECIALS = [PAD, EOS, MASK, BOS, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE]


@dataclass
class Healing:
    """How the fill re-types the prefix's last `k` tokens (`text`): slot 0 takes one of `first`;
    when that is a shorter piece of `text` (a key of `then`), slot 1 takes one of `then[piece]`."""

    k: int
    text: str
    first: list[int]
    then: dict[int, list[int]]


LINE_CACHE = 16384  # pieces of far text whose ids TextTokenizer.encode_lines keeps
_LINE_CUT = re.compile(r"(?<=\S)(?=\n)")


class TextTokenizer:
    """Text <-> ids; a thin wrapper so the engine never touches `tokenizers` types."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._texts: list[str] | None = None  # per id: the token's text (built on first use)
        self._lines: OrderedDict[str, list[int]] = OrderedDict()  # encode_lines' pieces, least recent first
        self._lines_lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path) -> TextTokenizer:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        return cls(Tokenizer.from_file(str(p)))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(_no_lone_surrogates(text), add_special_tokens=False).ids if text else []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch([_no_lone_surrogates(t) for t in texts], add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def heal(self, prefix: list[int], max_back: int = 3) -> Healing | None:
        """Token healing (as in Microsoft Guidance): a prefix cut by the cursor ends in tokens the
        model rarely saw at that place (`impo|` -> `imp` `o` where text had `import`; the indentation
        `\\n        ` where text had `\\n       ` + ` self`). Returns how to re-type the tail: the last k
        tokens are removed, and the fill's first token must either extend their text (`import`) or
        be a shorter piece of it whose remainder the second token extends (`\\n       `, then a
        token starting with ` `). k is the longest (<= max_back) whose text some token extends.
        None when nothing to heal: the tail is special or not whole UTF-8, or the last token itself
        is its only re-typing."""
        if self._texts is None:
            self._texts = [self.tok.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)]
            # this project's specials by name, and every added special token of a family's tokenizer
            # (<|im_start|>, <|mdm_mask|>, ...): a fill never re-types the cursor's text with one
            self._special = {self.tok.token_to_id(t) for t in SPECIALS} | {
                i for i, t in self.tok.get_added_tokens_decoder().items() if t.special
            }
            self._sorted = sorted(
                (t, i) for i, t in enumerate(self._texts) if i not in self._special and "\ufffd" not in t
            )
            self._by_text = {t: i for t, i in self._sorted}  # whole-UTF-8 texts are unique per token
        for k in range(min(max_back, len(prefix)), 0, -1):
            tail = prefix[len(prefix) - k :]
            if any(i in self._special or not 0 <= i < len(self._texts) for i in tail):
                continue
            text = self.decode(tail)
            if not text or "\ufffd" in text:
                continue
            ext = self._extending(text)
            if not ext:
                continue
            then: dict[int, list[int]] = {}
            for cut in range(1, len(text)):  # shorter pieces whose remainder some token extends
                piece = self._by_text.get(text[:cut])
                rest = self._extending(text[cut:])
                if piece is not None and rest:
                    then[piece] = rest
            if k > 1 or len(ext) + len(then) >= 2:
                return Healing(k, text, sorted(set(ext) | set(then)), then)
        return None

    def _extending(self, text: str) -> list[int]:
        """Ids of the ordinary tokens whose text starts with `text`: a range of the sorted texts."""
        lo = bisect.bisect_left(self._sorted, (text,))
        hi = bisect.bisect_left(self._sorted, (text + "\U0010ffff",))
        return [i for _, i in self._sorted[lo:hi]]

    def encode_lines(self, text: str) -> list[int]:
        """encode(text) for a long text that is mostly the same from one call to the next (a fill's
        far text: the snippets of other files and the document beyond the window): it is cut before
        each line break that follows a non-space character, and each piece's ids are kept (the
        latest LINE_CACHE pieces), so a keystroke tokenizes only the pieces that changed. The GPT-2
        byte-level pre-tokenizer never puts a non-space character and the whitespace after it in one
        piece, and what it does after that point depends only on the text from there on, so the ids
        are exactly encode(text)'s (as in encode_edit; other tokenizers: encode)."""
        text = _no_lone_surrogates(text)
        if not self.edit_ok or len(text) < 2048:
            return self.encode(text)
        pieces = _LINE_CUT.split(text)
        with self._lines_lock:
            cache = self._lines
            got = [cache.get(p) for p in pieces]
            for p, ids in zip(pieces, got):
                if ids is not None:
                    cache.move_to_end(p)
        missing = sorted({p for p, ids in zip(pieces, got) if ids is None})
        new: dict[str, list[int]] = {}
        if missing:
            new = dict(zip(missing, self.encode_batch(missing)))
            with self._lines_lock:
                for p, ids in new.items():
                    self._lines[p] = ids
                while len(self._lines) > LINE_CACHE:
                    self._lines.popitem(last=False)
        return [i for p, ids in zip(pieces, got) for i in (ids if ids is not None else new[p])]

    def encode_edit(self, old_text: str, old_ids: list[int], text: str) -> list[int]:
        """encode(text), given an earlier text and its ids (a document's previous request): the ids
        before the last safe boundary ahead of the first changed character are taken over and only
        the text from there on is tokenized (per keystroke: the current line, not the whole prefix).

        A safe boundary b (`_boundary`): text[b-1] and text[b] are whitespace and text[b+1] is not:
        an indented line's last indent character, or a blank line's break. The GPT-2 byte-level
        pre-tokenizer always ends a piece there (a whitespace run before a non-space ends, less its
        last character, as one piece; no piece reaches into a run from before it), and what it does
        after b depends only on the text from b on, while byte-level BPE merges within a piece. So
        tokenizing text[b:] gives exactly the whole text's ids after b. Only for tokenizers of that
        kind (`edit_ok`); any other, no boundary, or the old ids not ending a token at b: the whole
        text is tokenized. tests/test_tokenizer_edit.py checks it against encode on edited files."""
        text, old_text = _no_lone_surrogates(text), _no_lone_surrogates(old_text)
        if text == old_text:
            return list(old_ids)
        if not self.edit_ok:
            return self.encode(text)
        b = _boundary(text, common_prefix(old_text, text))
        if b is None:
            return self.encode(text)
        nbytes = len(text[:b].encode("utf-8"))
        ids = np.asarray(old_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self._byte_len.size):
            return self.encode(text)
        ends = np.cumsum(self._byte_len[ids])  # byte offset after each old token
        i = int(np.searchsorted(ends, nbytes))  # the old tokens before byte nbytes: i of them, if one ends there
        if nbytes and (i >= ends.size or ends[i] != nbytes):
            return self.encode(text)  # no old token ends at the boundary (not the text those ids were of)
        keep = i + 1 if nbytes else 0
        return list(old_ids[:keep]) + self.encode(text[b:])

    @property
    def edit_ok(self) -> bool:
        """True when encode_edit's boundary argument holds for this tokenizer: byte-level BPE with the
        GPT-2 split pattern, no prefix space, no normalizer, no added token with whitespace in it."""
        if getattr(self, "_edit_ok", None) is None:
            spec = json.loads(self.tok.to_str())
            pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
            self._edit_ok = (
                spec.get("normalizer") is None
                and model.get("type") == "BPE"
                and pre.get("type") == "ByteLevel"
                and pre.get("use_regex", True)
                and not pre.get("add_prefix_space", False)
                and not any(re.search(r"\s", a["content"]) for a in spec.get("added_tokens") or [])
            )
            if self._edit_ok:  # bytes per id: a byte-level token's string has one character per byte
                added = {a["id"]: len(a["content"].encode("utf-8")) for a in spec.get("added_tokens") or []}
                vocab = model.get("vocab") or {}
                lengths = [0] * self.vocab_size
                for t, i in vocab.items():
                    if 0 <= i < len(lengths):
                        lengths[i] = len(t)
                for i, n in added.items():
                    if 0 <= i < len(lengths):
                        lengths[i] = n
                self._byte_len = np.asarray(lengths, dtype=np.int64)
        return self._edit_ok

    def newline_ids(self) -> tuple[int, ...]:
        """Ids of the ordinary tokens whose text is whitespace with a line break in it (`\\n`,
        `\\n    `, `\\n\\n`): where a single-line fill ends (DecodeOptions.stop_newline). Built once."""
        if getattr(self, "_newlines", None) is None:
            added = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
            self._newlines = tuple(
                i
                for i in range(self.vocab_size)
                if i not in added and "\n" in (t := self.tok.decode([i], skip_special_tokens=False)) and not t.strip()
            )
        return self._newlines

    def token_text(self, i: int) -> str:
        return self.tok.decode([i], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def save(self, folder: str | Path) -> None:
        self.tok.save(str(Path(folder) / "tokenizer.json"))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(text: str) -> str:
    """`text` with each lone surrogate (an editor may send one; a str holds no valid pairs) as U+FFFD:
    `tokenizers` takes only valid Unicode. One character for one, so offsets do not move."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b (slice compares: C speed, log n of them)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo], a[:hi+1] != b[:hi+1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_WS = " \t\n"


def _boundary(text: str, limit: int, lines: int = 64) -> int | None:
    """The last b with b + 1 < limit where text[b-1], text[b] are whitespace (space, tab, line break)
    and text[b+1] is printable ASCII other than space (TextTokenizer.encode_edit): per line, the
    last indent character. Looks back over at most `lines` lines; None when there is none."""
    end = min(limit, len(text))
    for _ in range(lines):
        s = text.rfind("\n", 0, end) + 1  # the line start (0: the text's first line)
        f = s
        while f < len(text) and text[f] in " \t":
            f += 1
        b = f - 1
        if (
            b >= 1
            and b + 1 < limit
            and f < len(text)
            and text[b] in _WS
            and text[b - 1] in _WS
            and "!" <= text[f] <= "~"
        ):
            return b
        if s == 0:
            return None
        end = s - 1
    return None


def train_bpe(texts: Iterable[str], vocab_size: int = 8192) -> TextTokenizer:
    """Trains a byte-level BPE on an iterable of strings; special tokens get ids 0..6."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(tok)
