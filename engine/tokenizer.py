"""Byte-level BPE tokenizer (tokenizer.json via `tokenizers`) with the special ids the engine needs."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Names of the special tokens in tokenizers this project trains. Their ids are whatever the trained
# tokenizer assigns; the engine reads them from config.json, never from here.
PAD, EOS, MASK, BOS = "<|pad|>", "<|endoftext|>", "<|mask|>", "<|bos|>"
# fill-in-the-middle markers for the autoregressive twin (the diffusion model infills literally)
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
SPECIALS = [PAD, EOS, MASK, BOS, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE]


class TextTokenizer:
    """Text <-> ids; a thin wrapper so the engine never touches `tokenizers` types."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._texts: list[str] | None = None  # per id: the token's text (built on first use)
        self._heal: dict[str, list[int]] = {}  # per healed text: the tokens that start with it

    @classmethod
    def load(cls, path: str | Path) -> "TextTokenizer":
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        return cls(Tokenizer.from_file(str(p)))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids if text else []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def heal(self, prefix: list[int], max_back: int = 3) -> tuple[int, list[int], str]:
        """Token healing (as in Microsoft Guidance): a prefix cut by the cursor mid-word ends in
        tokens the model rarely saw at a word's end (`impo|` -> `imp` `o`, where text had `import`).
        Returns (k, candidates, text): remove the prefix's last k tokens (their text), and let the
        fill's first token be one of `candidates`, the vocabulary tokens whose text starts with that
        text; the longest k <= max_back that some token extends. (0, [], "") when nothing to heal:
        the tail is special or not whole UTF-8, or only the last token itself starts with its text."""
        if self._texts is None:
            self._texts = [self.tok.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)]
            self._special = {self.tok.token_to_id(t) for t in SPECIALS}
        for k in range(min(max_back, len(prefix)), 0, -1):
            tail = prefix[len(prefix) - k :]
            if any(i in self._special or not 0 <= i < len(self._texts) for i in tail):
                continue
            text = self.decode(tail)
            if not text or "\ufffd" in text:
                continue
            if text not in self._heal:
                if len(self._heal) > 50_000:
                    self._heal.clear()
                self._heal[text] = [i for i, t in enumerate(self._texts)
                                    if t.startswith(text) and i not in self._special and "\ufffd" not in t]
            cands = self._heal[text]
            if len(cands) >= (2 if k == 1 else 1):
                return k, cands, text
        return 0, [], ""

    def token_text(self, i: int) -> str:
        return self.tok.decode([i], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def save(self, folder: str | Path) -> None:
        self.tok.save(str(Path(folder) / "tokenizer.json"))


def train_bpe(texts, vocab_size: int = 8192) -> TextTokenizer:
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
