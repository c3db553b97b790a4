"""Synthetic next-edit cases from one training file's own code: the user changes ONE site of an intent
and the truth is the change the same intent implies at the following site(s). Real edits (release
pairs, engine/train/edit_pairs.py) are scarce; these fill the training set in the same case format.

    a file's text (it must parse with `ast`, at most synth_source.MAX_CHARS characters), read as code
    tokens and a tree (engine/train/synth_source.py)
        v
    its INTENTS, per kind (engine/train/synth_kinds.py: rename, add_param, type_hint, quote_style,
    typing_builtin), each a list of sites top to bottom, a site (offset in the file, old, new)
        v
    a CASE per intent: its first one or two sites are the user's edits (each trimmed, its offset in the
    text at that moment, as edit_pairs replays hunks), the cursor at the end of the last; the truth ONE
    trimmed edit from the first to the last changed character of the following sites, as many as fit
    in MAX_HUNK_LINES lines, starting within REACH lines of the cursor (else no case); a NOISE case when
    the user's edits are all of an intent's sites (one or two): nothing is left, the truth is null
        v
    the category by edit_pairs.file_cases' own rule: "repeat" when the truth's token substitutions
    (edit_pairs.substitutions of the whole lines, before and after) share one with the user's edits',
    else "other". A synthetic case is thus labelled as a real one with the same edits would be: rename
    and the typing aliases come out "repeat"; add_param, type_hint, quote_style and Optional[X] repeat
    an insertion or punctuation, which that rule cannot see, and come out "other" (kept: the "kind"
    field says what they repeat)
        v
    checked: the lines the case changes still parse, after the user's edits and after the truth; per
    file at most PER_FILE cases that are not noise, the kinds taken in turn, and noise at most
    NOISE_SHARE of the file's cases

A case: {"kind", "tag" (its name in the file), "edits", "cursor", "truth", "category"}, the fields of
edit_pairs' cases that a file's text decides; engine/train/edit_data.py adds the rest.
"""

from __future__ import annotations

import random

from engine.train.edit_pairs import MAX_HUNK_LINES, REACH, Edit, apply_edits, substitutions, trimmed
from engine.train.synth_kinds import INTENTS, Intent
from engine.train.synth_source import read_source

PER_FILE = 6  # cases (not noise) one file gives at most, as edit_pairs.PER_FILE
NOISE_SHARE = 0.25  # noise cases make at most this share of a file's cases (edit_pairs: 2 of 8)
KINDS = tuple(INTENTS)


def _lines_between(text: str, a: int, b: int) -> int:
    """Whole lines strictly between the line of offset a and that of offset b >= a."""
    return max(0, text.count("\n", a, b) - 1)


def _line_subs(text: str, e: Edit) -> set[tuple[str, str]]:
    """edit_pairs.substitutions of the whole lines an edit touches, before and after it."""
    off, old, new = e
    a = text.rfind("\n", 0, off) + 1
    b = text.find("\n", off + len(old))
    b = len(text) if b < 0 else b
    return substitutions(text[a:b], text[a:off] + new + text[off + len(old) : b])


def intent_case(text: str, it: Intent, n_user: int) -> tuple[dict, int] | None:
    """(the case where the user made the intent's first n_user sites, how many sites its document after
    the truth holds), or None when the truth starts out of reach or its first site is too long, or
    when it would be noise of an intent with sites elsewhere."""
    edits: list[Edit] = []
    shift = 0
    for off, old, new in it.sites[:n_user]:
        edits.append(trimmed(off + shift, old, new))
        shift += len(new) - len(old)
    doc = apply_edits(text, edits)
    cursor = edits[-1][0] + len(edits[-1][2])
    case = {"kind": it.kind, "edits": [list(e) for e in edits], "cursor": cursor, "truth": None, "category": "noise"}
    rest = [(off + shift, old, new) for off, old, new in it.sites[n_user:]]
    if not rest:
        return ({**case, "tag": f"{it.kind}@{it.sites[0][0]}-noise"}, n_user) if it.complete else None
    start = rest[0][0]
    if _lines_between(doc, cursor, start) > REACH:
        return None
    truth, done, pieces, pos = None, n_user, [], start
    for off, old, new in rest:
        pieces += [doc[pos:off], new]
        pos = off + len(old)
        t = trimmed(start, doc[start:pos], "".join(pieces))
        if max(t[1].count("\n"), t[2].count("\n")) + 1 > MAX_HUNK_LINES:
            break
        truth, done = t, done + 1
    if truth is None:
        return None
    replayed: set[tuple[str, str]] = set()
    at = text
    for e in edits:
        replayed |= _line_subs(at, e)
        at = apply_edits(at, [e])
    cat = "repeat" if _line_subs(doc, truth) & replayed else "other"
    return {**case, "truth": list(truth), "category": cat, "tag": f"{it.kind}@{it.sites[0][0]}+{n_user}"}, done


def _noise_cap(n: int) -> int:
    """Noise cases allowed beside n that are not: at most NOISE_SHARE of all."""
    return int(n * NOISE_SHARE / (1 - NOISE_SHARE))


def _tries(it: Intent, rng: random.Random) -> list[int]:
    """How many of an intent's sites the user made, per case: with three or more, the first one or two;
    with two, the first (the truth is the second) and both (noise); with one, that one (noise)."""
    n = len(it.sites)
    return ([rng.choice([1, 2]) if n > 2 else 1] if n > 1 else []) + ([n] if n <= 2 else [])


def synthetic_cases(text: str, rng: random.Random, per_file: int = PER_FILE) -> list[dict]:
    """A file's cases: at most per_file that are not noise, the kinds taken in turn (each kind's intents
    in a random order), then noise at most NOISE_SHARE of them; [] for a file that does not parse or is
    over synth_source.MAX_CHARS. Deterministic for the rng's state."""
    src = read_source(text)
    if src is None:
        return []
    pools = []
    for kind in KINDS:
        its = INTENTS[kind](src, rng)
        rng.shuffle(its)
        pools.append(its)
    real: list[dict] = []
    noise: list[dict] = []
    for k in range(max(map(len, pools), default=0)):
        if len(real) >= per_file and len(noise) >= _noise_cap(per_file):
            break
        for it in (p[k] for p in pools if k < len(p)):
            for n_user in _tries(it, rng):
                made = intent_case(src.text, it, n_user)
                if made is None:
                    continue
                into, cap = (real, per_file) if made[0]["truth"] else (noise, _noise_cap(per_file))
                # parsed last, and only when the case is wanted: it costs more than the rest
                if len(into) < cap and src.parses_with(it.sites[:n_user]) and src.parses_with(it.sites[: made[1]]):
                    into.append(made[0])
    return real + noise[: _noise_cap(len(real))]
