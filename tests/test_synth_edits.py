"""Synthetic next-edit cases (engine/train/synth_edits.py, synth_kinds.py, synth_source.py) and their
builder (`dlm-lsp corpus --synthetic-edits`, engine/train/edit_data.py), on tiny sources written here:
each kind's cases, replayed, give the fully edited file worked out here independently (a whole-function
rename with tokenize, or the file written out by hand); strings and comments stay; the reach and hunk
limits; noise; only the train side of a fake corpus; one seed, one data set."""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import json
import keyword
import random
import re
import tokenize
from collections import Counter
from pathlib import Path

import pytest

from engine.train import corpus
from engine.train.corpus_cli import add_corpus_args, run_corpus
from engine.train.edit_data import build_synthetic
from engine.train.edit_pairs import MAX_HUNK_LINES, REACH, apply_edits, load_case
from engine.train.synth_edits import NOISE_SHARE, intent_case, synthetic_cases
from engine.train.synth_kinds import INTENTS, Intent, new_name
from engine.train.synth_source import MAX_CHARS, read_source


def _after(src: str, case: dict) -> tuple[str, str]:
    """(document after the user's edits, document after the truth too)."""
    doc = apply_edits(src, case["edits"])
    return doc, apply_edits(doc, [case["truth"]]) if case["truth"] else doc


def _cases(src: str, kind: str, seeds: range = range(12)) -> list[dict]:
    """Every case of a kind synthetic_cases gives for src over a few seeds (no per-file cap in the way)."""
    return [c for s in seeds for c in synthetic_cases(src, random.Random(s), per_file=100) if c["kind"] == kind]


def _intent_finals(src: str, kind: str) -> list[tuple[Intent, str]]:
    """(intent, file after the user's first site and the truth) for each intent of a kind in src."""
    out = []
    for it in INTENTS[kind](read_source(src), random.Random(0)):
        made = intent_case(src, it, 1)
        if made is not None and made[0]["truth"]:
            out.append((it, _after(src, made[0])[1]))
    return out


def _strings_and_comments(text: str) -> list[str]:
    toks = tokenize.generate_tokens(io.StringIO(text).readline)
    return [t.string for t in toks if t.type in (tokenize.STRING, tokenize.COMMENT)]


# ---------------------------------------------------------------------- rename

RENAME = """import os


def total(items, scale):
    value = 0  # value starts at zero
    for item in items:
        value += item.value * scale
    print("value:", value, sep=os.sep, value=1)
    return value


class Box:
    def grow(self, factor):
        self.factor = factor
        size = self.size * factor
        return size


def other(value):
    return value + 1
"""


def _renamed(src: str, first: int, last: int, old: str, new: str) -> str:
    """src with the NAME tokens `old` on lines first..last renamed: the oracle's rule, written apart from
    the kind's: not after a '.', not a call's keyword (inside brackets and before '=' on a line that is
    not a def's)."""
    lines = src.splitlines(keepends=True)
    toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    at, depth = [], 0
    for k, t in enumerate(toks):
        depth += (t.string in "([{") - (t.string in ")]}") if t.type == tokenize.OP else 0
        if t.type != tokenize.NAME or t.string != old or not first <= t.start[0] <= last:
            continue
        keyword_arg = depth and toks[k + 1].string == "=" and not lines[t.start[0] - 1].lstrip().startswith("def ")
        if toks[k - 1].string != "." and not keyword_arg:
            at.append(t.start)
    for row, col in reversed(at):
        ln = lines[row - 1]
        lines[row - 1] = ln[:col] + new + ln[col + len(old) :]
    return "".join(lines)


def _function_at(src: str, line: int) -> ast.FunctionDef:
    fns = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.lineno <= line <= n.end_lineno]
    return min(fns, key=lambda f: f.end_lineno - f.lineno)


def test_rename_cases_give_the_whole_function_renamed_and_leave_strings_and_comments():
    cases = _cases(RENAME, "rename")
    assert {c["category"] for c in cases} == {"repeat", "noise"}
    olds = set()
    for c in cases:
        doc, final = _after(RENAME, c)
        old, new, line = _old_new(RENAME, c)
        fn = _function_at(RENAME, line)
        assert final == _renamed(RENAME, fn.lineno, fn.end_lineno, old, new), (old, new)
        assert _strings_and_comments(final) == _strings_and_comments(RENAME)
        ast.parse(doc), ast.parse(final)
        fn_words = set(re.findall(r"\w+", "".join(RENAME.splitlines(keepends=True)[fn.lineno - 1 : fn.end_lineno])))
        assert new not in fn_words and not keyword.iskeyword(new) and new not in dir(builtins)
        olds.add((fn.name, old))
    # every local with a plausible new name is renamed by some case (`scale` and `factor` have none);
    # `os` (a global) and `self` never are
    assert olds == {("total", "items"), ("total", "value"), ("total", "item"), ("grow", "size"), ("other", "value")}


def test_new_name_never_takes_a_name_in_use():
    rng = random.Random(0)
    assert {new_name("value", set(), [], rng) for _ in range(20)} == {"val"}
    assert new_name("value", {"val"}, [], rng) is None  # its only candidate is taken, and no other
    assert {new_name("max_line_length", {"max_line_len", "line_length"}, [], rng) for _ in range(30)} == {"max_line"}
    assert new_name("result", {"res", "out"}, [], rng) is None
    assert {new_name("inputValue", set(), [], rng) for _ in range(60)} == {"input_value", "value", "input_val"}
    assert {new_name("length", set(), [], rng) for _ in range(30)} == {"size"}  # `len` is a builtin
    # no derived name left: a name of the file sharing a word with it
    assert new_name("value", {"val"}, ["other", "new_value"], rng) == "new_value"


@pytest.mark.parametrize(
    "body",
    [
        "    global value\n    value = 1\n    return value\n",  # a global: not this function's name
        '    value = 1\n    return f"{value}"\n',  # an f-string holds it: the tokens do not see it
        "    value = 1\n    return locals()\n",  # read by its string
        "    value = 1\n    def inner(value):\n        return value\n    return value\n",  # shadowed
        "    value = 1\n    return [value for value in range(value)]\n",  # rebound by a comprehension
        "    try:\n        value = 1\n    except E as value:\n        pass\n    return value\n",
    ],
)
def test_rename_skips_a_name_whose_tokens_and_tree_disagree(body):
    src = f"def f():\n{body}"
    its = INTENTS["rename"](read_source(src), random.Random(0))
    assert all(src.index("value = 1") not in [o for o, _, _ in it.sites] for it in its)  # (inner's own: may)
    # the same function without the catch gives the rename
    assert any(it.sites[0][1] == "value" for it in INTENTS["rename"](read_source(RENAME), random.Random(0)))


# ---------------------------------------------------------------------- add_param

ADD_PARAM = """def area(width, height):
    return width * height


def report(w, h):
    print(area(w, h))
    return area(w, height=h)


def unused(x):
    return x
"""


def test_add_param_appends_the_parameter_and_passes_it_at_each_call_below():
    finals = _intent_finals(ADD_PARAM, "add_param")
    assert [it.sites[0][0] for it, _ in finals] == [ADD_PARAM.index("height)") + len("height")]
    it, final = finals[0]
    param = it.sites[0][2][2:]  # ", name" or ", name=default"
    name = param.split("=")[0]
    assert re.fullmatch(r"[a-z_]+(=(None|False))?", param)
    assert final == ADD_PARAM.replace("area(width, height)", f"area(width, height, {param})").replace(
        "area(w, h)", f"area(w, h, {name})"
    ).replace("area(w, height=h)", f"area(w, height=h, {name}={name})")
    ast.parse(final)
    # `report` and `unused` have no call: the parameter is all there is, a noise case
    its = INTENTS["add_param"](read_source(ADD_PARAM), random.Random(0))
    assert [len(i.sites) for i in its] == [3, 1, 1]
    for i in its[1:]:
        case, done = intent_case(ADD_PARAM, i, 1)
        assert case["truth"] is None and case["category"] == "noise" and done == 1
    calls_above = "def late(a):\n    return a\n\n\nx = early(1)\n\n\ndef early(a):\n    return late(a)\n"
    (late, early) = INTENTS["add_param"](read_source(calls_above), random.Random(0))
    assert intent_case(calls_above, early, 1) is None  # a call above it is left: no noise case
    assert intent_case(calls_above, late, 1)[0]["truth"][1:] == ["", ", " + late.sites[0][2][2:].split("=")[0]]


# ---------------------------------------------------------------------- type_hint

TYPE_HINT = """class Shape:
    def __init__(self, name, size=1):
        self.name = name

    def rename(self, name):
        self.name = name

    def describe(self, name, size=None):
        return f"{name} {size}"

    def scale(self, factor):
        return factor


def label(name: str):
    return name
"""


def test_type_hint_goes_to_the_same_parameter_of_the_sibling_methods():
    finals = {it.sites[0][1] + ":" + str(len(it.sites)): final for it, final in _intent_finals(TYPE_HINT, "type_hint")}
    # `name`: the file hints it `str` elsewhere; `size`: its name suggests int; `factor`: one method only
    assert set(finals) == {":3", "=:2"}
    assert finals[":3"] == TYPE_HINT.replace("(self, name", "(self, name: str")
    assert finals["=:2"] == TYPE_HINT.replace("size=1", "size: int = 1").replace("size=None", "size: int | None = None")
    for c in _cases(TYPE_HINT, "type_hint"):
        ast.parse(_after(TYPE_HINT, c)[1])
        assert c["category"] in ("other", "noise")  # an insertion: no token substitution to repeat


# ---------------------------------------------------------------------- quote_style

QUOTES = """A = 'a'  # 'comment' stays
B = 'it\\'s'
C = "c"
D = 'd'
E = '''e'''
F = b'f'
G = "g"
H = "h"
I = "i"
"""


def test_quote_style_switches_only_the_simple_literals_of_the_minority():
    ((it, final),) = _intent_finals(QUOTES, "quote_style")
    assert final == QUOTES.replace("'a'", '"a"').replace("'d'", '"d"').replace("b'f'", 'b"f"')
    assert "'comment' stays" in final and "'it\\'s'" in final and "'''e'''" in final
    cases = _cases(QUOTES, "quote_style")
    assert {c["category"] for c in cases} == {"other"} and all(ast.parse(_after(QUOTES, c)[1]) for c in cases)


def test_the_truth_stops_at_max_hunk_lines_and_needs_reach():
    lits = "".join(f"X{i} = 'x'\n" for i in range(MAX_HUNK_LINES + 5))
    ((it,),) = [INTENTS["quote_style"](read_source(lits), random.Random(0))]
    case, done = intent_case(lits, it, 1)
    assert case["truth"][1].count("\n") + 1 == MAX_HUNK_LINES and done == 1 + MAX_HUNK_LINES
    final = _after(lits, case)[1]
    assert final.count('"x"') == 1 + MAX_HUNK_LINES and final.count("'x'") == 4
    for gap, reached in [(REACH, True), (REACH + 1, False)]:
        src = "def f():\n    value = 1\n" + "    pass\n" * gap + "    return value\n"
        (ren,) = [i for i in INTENTS["rename"](read_source(src), random.Random(0)) if i.sites[0][1] == "value"]
        assert (intent_case(src, ren, 1) is not None) == reached


# ---------------------------------------------------------------------- typing_builtin

TYPING = """from typing import Dict, Optional
import typing


def f(a: Dict[str, int], b: Optional[int] = None) -> typing.Dict[str, int]:
    c: Dict[str, Optional[str]] = {}
    d: Optional["Foo"] = None  # Optional[str] in a comment stays
    return "Dict[str, int]"
"""


def test_typing_aliases_become_builtins_and_optional_a_union_with_none():
    finals = {it.sites[0][1]: final for it, final in _intent_finals(TYPING, "typing_builtin")}
    assert finals["Dict"] == (
        TYPING.replace("a: Dict[", "a: dict[").replace("typing.Dict[", "dict[").replace("c: Dict[", "c: dict[")
    )
    assert finals["Optional[int]"] == TYPING.replace("Optional[int]", "int | None").replace(
        "Optional[str]]", "str | None]"
    )
    for c in _cases(TYPING, "typing_builtin"):
        ast.parse(_after(TYPING, c)[1])
        first = TYPING[c["edits"][0][0] :]
        assert c["category"] == ("noise" if c["truth"] is None else "repeat" if first[:1] == "D" else "other")


# ---------------------------------------------------------------------- the file's cases


def _old_new(src: str, case: dict) -> tuple[str, str, int]:
    """(old name, new name, its line) of a rename case: the source's word at the user's first edit, and
    the word that starts there in the document."""
    off = case["edits"][0][0]
    start = max(m.start() for m in re.finditer(r"\b\w", src[: off + 1]))
    doc = apply_edits(src, case["edits"])
    return re.match(r"\w+", src[start:])[0], re.match(r"\w+", doc[start:])[0], src.count("\n", 0, start) + 1


def test_noise_cases_hold_an_intents_every_site_and_no_truth():
    src = "def f(line):\n    return line\n\n\ndef g(item):\n    item = item + 1\n    return item\n"
    line, item = INTENTS["rename"](read_source(src), random.Random(0))
    case, _ = intent_case(src, line, 2)
    assert case["truth"] is None and case["category"] == "noise" and len(case["edits"]) == 2
    assert _after(src, case)[0] == _renamed(src, 1, 2, "line", "row")
    assert intent_case(src, line, 1)[0]["category"] == "repeat" and len(item.sites) == 4
    # synthetic_cases makes noise of the intents with one or two sites only: all of them done
    noise = [c for s in range(10) for c in synthetic_cases(RENAME + src, random.Random(s)) if c["truth"] is None]
    noise = [c for c in noise if c["kind"] == "rename"]
    assert noise
    for c in noise:
        old, new, line = _old_new(RENAME + src, c)
        fn = _function_at(RENAME + src, line)
        assert len(c["edits"]) <= 2 and c["category"] == "noise"
        assert _after(RENAME + src, c)[0] == _renamed(RENAME + src, fn.lineno, fn.end_lineno, old, new)
    for s in range(10):
        got = synthetic_cases(RENAME + src, random.Random(s))
        assert sum(c["truth"] is None for c in got) <= NOISE_SHARE * len(got)


def test_a_file_that_does_not_parse_or_is_too_big_gives_nothing():
    assert synthetic_cases("def f(:\n    pass\n", random.Random(0)) == []
    big = RENAME + "# " + "x" * MAX_CHARS + "\n"
    assert synthetic_cases(big, random.Random(0)) == [] and synthetic_cases(RENAME, random.Random(0))


def test_synthetic_cases_are_deterministic_for_a_seed():
    src = RENAME + ADD_PARAM + TYPE_HINT + QUOTES + TYPING
    a = synthetic_cases(src, random.Random(7))
    assert a == synthetic_cases(src, random.Random(7))
    assert {c["kind"] for c in a} == {"rename", "add_param", "type_hint", "quote_style", "typing_builtin"}
    assert len({c["tag"] for c in a}) == len(a)


# ---------------------------------------------------------------------- the builder

TRAIN = {"alpha:pkg/shapes.py": RENAME, "alpha:pkg/area.py": ADD_PARAM + TYPE_HINT, "beta:b.py": QUOTES + TYPING}
SNEAKY = "alpha:pkg/m3.py"  # listed as train, but corpus.is_heldout takes it


def _corpus(root: Path) -> Path:
    """A corpus folder as `dlm-lsp corpus` writes it (corpus.json, files/<package>/<path>): three train
    files, a held-out file, a held-out package's file, and two keys listed as train that are held out."""
    assert corpus.is_heldout(SNEAKY) and not any(map(corpus.is_heldout, TRAIN))
    files = {**TRAIN, "alpha:pkg/held.py": RENAME, "secret:s.py": RENAME, "secret:t.py": RENAME, SNEAKY: RENAME}
    for key, text in files.items():
        label, rel = key.split(":", 1)
        (root / "files" / label / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "files" / label / rel).write_text(text)
    meta = {
        "packages": [{"name": "alpha", "heldout": False}, {"name": "beta"}, {"name": "Secret", "heldout": True}],
        "train": [*TRAIN, SNEAKY, "secret:t.py"],
        "heldout": ["alpha:pkg/held.py"],
        "heldout_packages": ["secret:s.py"],
    }
    (root / "corpus.json").write_text(json.dumps(meta))
    return root


def _read(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "synthetic.jsonl").read_text().splitlines()]


def test_builder_writes_train_cases_only_and_load_case_reads_each(tmp_path):
    out = tmp_path / "out"
    s = build_synthetic(out, _corpus(tmp_path / "corpus"), seed=1, log=lambda m: None)
    cases = _read(out)
    assert {f"{c['package']}:{c['path']}" for c in cases} == set(TRAIN)
    assert s["files"] == {"train": 5, "skipped_heldout": 2, "with_cases": 3}
    assert (
        not (out / "files" / "synthetic" / "secret").exists()
        and not (out / "files" / "synthetic" / "alpha" / "m3.py").exists()
    )
    for c in cases:
        assert c["side"] == "train" and c["file"] == f"files/synthetic/{c['package']}/{c['path']}"
        assert (out / c["file"]).read_text() == TRAIN[f"{c['package']}:{c['path']}"]
        doc, after = load_case(out, c)
        ast.parse(doc), ast.parse(after)
        assert (c["truth"] is None) == (c["category"] == "noise") and (after == doc) == (c["truth"] is None)
    counted = Counter((c["kind"], c["category"]) for c in cases)
    assert {(k, cat): n for k, v in s["kinds"].items() for cat, n in v.items()} == counted
    assert {k for k, _ in counted} == {"rename", "add_param", "type_hint", "quote_style", "typing_builtin"}
    assert s["counts"]["total"] == dict(sorted(Counter(c["category"] for c in cases).items()))
    assert json.loads((out / "synthetic.json").read_text()) == s


def test_builder_is_deterministic_for_a_seed_and_capped_per_package(tmp_path):
    src = _corpus(tmp_path / "corpus")
    runs = {}
    for name, seed in [("a", 5), ("b", 5), ("c", 6)]:
        build_synthetic(tmp_path / name, src, seed=seed, log=lambda m: None)
        runs[name] = [(tmp_path / name / f).read_bytes() for f in ("synthetic.jsonl", "synthetic.json")]
    assert runs["a"] == runs["b"]
    assert runs["a"][0] != runs["c"][0]
    build_synthetic(tmp_path / "a", src, seed=5, log=lambda m: None)  # again into the same folder
    assert (tmp_path / "a" / "synthetic.jsonl").read_bytes() == runs["a"][0]
    build_synthetic(tmp_path / "cap", src, seed=5, per_package=2, per_package_noise=0, log=lambda m: None)
    per = Counter(c["package"] for c in _read(tmp_path / "cap"))
    assert per == {"alpha": 2, "beta": 2} and all(c["truth"] for c in _read(tmp_path / "cap"))


def test_cli_flag_builds_synthetic_edits(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_corpus_args(p)
    src = _corpus(tmp_path / "corpus")
    args = p.parse_args(["--synthetic-edits", str(tmp_path / "out"), "--from", str(src), "--seed", "3"])
    assert run_corpus(args) == 0
    assert "synthetic.jsonl" in capsys.readouterr().out and _read(tmp_path / "out")
    args = p.parse_args(["--synthetic-edits", str(tmp_path / "out2"), "--from", str(tmp_path / "none")])
    assert run_corpus(args) == 2
    assert "corpus.json not found" in capsys.readouterr().err
