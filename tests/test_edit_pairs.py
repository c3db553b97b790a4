"""`dlm-lsp corpus --edits`: hunks, replayed edits, the reach rule, noise, categories, licences and sides,
on tiny releases written here as folders (and zipped into wheels for the build; no download)."""

from __future__ import annotations

import argparse
import json
import zipfile
from collections import Counter
from pathlib import Path

import pytest

import engine.train.edit_pairs as ep
from engine.train.corpus_build import Pin
from engine.train.corpus_cli import add_corpus_args, run_corpus
from engine.train.edit_pairs import (
    MAX_HUNK_LINES,
    REACH,
    apply_edits,
    build_edits,
    file_cases,
    hunks,
    load_case,
    pair_files,
    read_folder,
)


def _lines(n: int, tag: str = "v") -> list[str]:
    return [f"{tag}_{i} = compute_{i}(argument, other)\n" for i in range(n)]


def _changed(old: list[str], at: dict[int, str]) -> list[str]:
    """old with the lines at the given indices replaced (a value may hold several lines, or none)."""
    return [at.get(i, ln) for i, ln in enumerate(old)]


def _release(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _wheel(cache: Path, name: str, version: str, folder: Path, licence: str = "MIT") -> None:
    """The folder as a wheel of name==version in the pip cache `fetch` looks in."""
    cache.mkdir(parents=True, exist_ok=True)
    meta = f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\nLicense-Expression: {licence}\n\n"
    with zipfile.ZipFile(cache / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        for rel, data in sorted(read_folder(folder).items()):
            z.writestr(rel, data)


def test_hunks_are_cut_top_to_bottom_and_big_ones_are_dropped():
    old = _lines(80)
    big = "".join(f"rewritten_{k} = 1\n" for k in range(MAX_HUNK_LINES + 1))
    new = _changed(old, {3: "v_3 = changed(argument)\n", 10: big, 20: "v_20 = changed(argument)\n"})
    small = "".join(f"w_{k} = 2\n" for k in range(MAX_HUNK_LINES))
    new = _changed(new, {30: small})
    hs = hunks("".join(old), "".join(new))
    assert [(h.a, h.b) for h in hs] == [(3, 4), (10, 11), (20, 21), (30, 31)]
    assert [h.lines for h in hs] == [1, MAX_HUNK_LINES + 1, 1, MAX_HUNK_LINES]
    cases = file_cases("".join(old), "".join(new))
    # the big hunk is neither a truth nor replayed: hunk 0 is followed by it (no case, no noise), and
    # the case for hunk 3 replays hunk 2 alone
    assert [(c.after, c.category) for c in cases] == [(2, "other"), (3, "noise")]
    for c in cases:
        assert all("rewritten_" not in e[2] for e in c.edits)
    case = cases[0]
    assert len(case.edits) == 1 and small in apply_edits(apply_edits("".join(old), case.edits), [case.truth])


def _expected(old: list[str], at: dict[int, str], keep: list[int]) -> str:
    return "".join(_changed(old, {i: at[i] for i in keep}))


def test_replayed_edits_give_the_document_and_the_truth_gives_the_new_region():
    old = _lines(60)
    at = {
        4: "v_4 = compute_4(argument)\n",
        8: "",  # a deleted line
        12: "v_12 = compute_12(argument, other)\nextra_line = 1\n",  # one line added
        16: "v_16 = renamed(argument, other)\n",
        19: "v_19 = compute_19(argument, other, more)\n",
    }
    rows = sorted(at)
    new = _changed(old, at)
    cases = file_cases("".join(old), "".join(new))
    assert [c.after for c in cases] == [0, 1, 2, 3, 4]  # a case after every hunk; the last is noise
    for c in cases:
        lo = max(0, c.after - 2)  # at most 3 hunks replayed, the case's own last
        replayed = rows[lo : c.after + 1]
        doc = apply_edits("".join(old), c.edits)
        assert len(c.edits) == len(replayed)
        assert doc == _expected(old, at, replayed)
        if c.truth is None:
            continue
        after = apply_edits(doc, [c.truth])
        assert after == _expected(old, at, replayed + [rows[c.after + 1]])
        # the truth's region of the result is the new file's text there
        i = rows[c.after + 1]
        assert not at[i] or at[i] in after
    # the cursor sits at the end of the last replayed edit: right after the inserted line of hunk 2
    c2 = cases[2]
    doc = apply_edits("".join(old), c2.edits)
    assert doc[: c2.cursor].endswith("extra_line = 1\n")
    with pytest.raises(ValueError, match="expects"):
        apply_edits("abc", [(0, "x", "y")])


@pytest.mark.parametrize("gap,reached", [(REACH, True), (REACH + 1, False)])
def test_truth_only_within_reach_of_the_cursor(gap, reached):
    old = _lines(60)
    first, second = 5, 5 + 1 + gap  # `gap` unchanged lines between the two changed ones
    new = _changed(old, {first: "v_5 = changed(argument)\n", second: f"v_{second} = changed(argument)\n"})
    cases = file_cases("".join(old), "".join(new))
    got = [(c.after, c.category) for c in cases]
    if reached:
        assert got == [(0, "other"), (1, "noise")]
    else:
        # nothing follows within reach of the first: it ends in noise, and the second has no history
        assert got == [(0, "noise"), (1, "noise")]


def test_noise_at_the_end_of_a_file_keeps_the_document():
    old = _lines(30)
    new = _changed(old, {10: "v_10 = changed(argument)\n", 14: "v_14 = changed(argument)\n"})
    cases = file_cases("".join(old), "".join(new))
    last = cases[-1]
    assert last.category == "noise" and last.truth is None and last.after == 1
    doc = apply_edits("".join(old), last.edits)
    assert doc == "".join(new)  # both hunks replayed: nothing is left to suggest
    assert doc[: last.cursor].endswith("v_14 = changed(argument")  # the edit without the shared `)\n`


def test_a_rename_that_recurs_is_a_repeat():
    old = [f"total = old_name + {i}\n" if i % 5 == 0 else f"line_{i} = {i}\n" for i in range(40)]
    at = {i: old[i].replace("old_name", "new_name") for i in (0, 5, 10)}
    at[15] = "total = old_name + 15 + extra\n"  # a different change right after the renames
    new = _changed(old, at)
    cases = file_cases("".join(old), "".join(new))
    cats = {c.after: c.category for c in cases}
    assert cats[0] == "repeat" and cats[1] == "repeat"  # truths: the rename at lines 5 and 10
    assert cats[2] == "other"  # truth: `+ extra`, not the rename
    assert cats[3] == "noise"


def _pkg(root: Path, name: str, n_files: int, tag: str) -> tuple[Path, Path]:
    """Two releases of a package: n_files modules, each with three nearby changes."""
    old, new = {}, {}
    for k in range(n_files):
        lines = _lines(40, f"{tag}{k}")
        old[f"{name}/m{k}.py"] = "".join(lines)
        new[f"{name}/m{k}.py"] = "".join(
            _changed(lines, {r: lines[r].replace("argument", "argument_new") for r in (3, 7, 11)})
        )
    old[f"{name}/same.py"] = new[f"{name}/same.py"] = "x = 1\n"
    old[f"{name}/gone.py"] = "y = 1\n"
    return _release(root / f"{name}-old", old), _release(root / f"{name}-new", new)


def _versions(name: str, version: str, k: int) -> list[str]:
    return ["1.0"]


def _build(tmp_path: Path, out: Path, pins: list[Pin], licences: dict[str, str] | None = None, **kw) -> dict:
    cache = tmp_path / "wheels"
    for p in pins:
        o, n = _pkg(tmp_path / "src", p.name, 3, p.name)
        _wheel(cache, p.name, "1.0", o, (licences or {}).get(p.name, "MIT"))
        _wheel(cache, p.name, p.version, n)
    return build_edits(out, pins, wheels=cache, versions=_versions, log=lambda *_: None, **kw)


def test_pair_files_keeps_changed_files_in_both_releases(tmp_path):
    o, n = _pkg(tmp_path, "alpha", 2, "a")
    assert [rel for rel, _, _ in pair_files(read_folder(o), read_folder(n))] == ["alpha/m0.py", "alpha/m1.py"]


def test_licence_rule_refuses_a_package(tmp_path):
    s = _build(tmp_path, tmp_path / "out", [Pin("gamma", "2.0"), Pin("delta", "2.0")], {"gamma": "GPL-3.0-or-later"})
    (skip,) = s["skipped"]
    assert skip["package"] == "gamma" and "licence 'GPL-3.0-or-later'" in skip["reason"]
    cases = [json.loads(ln) for ln in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    cases += [json.loads(ln) for ln in (tmp_path / "out" / "heldout.jsonl").read_text().splitlines()]
    assert cases and {c["package"] for c in cases} == {"delta"}
    assert [p["package"] for p in s["pairs"]] == ["delta"]


def test_heldout_packages_are_kept_apart(tmp_path):
    out = tmp_path / "out"
    s = _build(tmp_path, out, [Pin("alpha", "2.0"), Pin("beta", "2.0", heldout=True)])
    sides = {side: [json.loads(ln) for ln in (out / f"{side}.jsonl").read_text().splitlines()] for side in ep.SIDES}
    assert sides["heldout_packages"] and {c["package"] for c in sides["heldout_packages"]} == {"beta"}
    assert all(c["package"] == "alpha" for c in sides["train"] + sides["heldout"])
    assert all(c["file"].startswith("files/heldout_packages/beta/") for c in sides["heldout_packages"])
    assert s["counts"]["heldout_packages"]["packages"].keys() == {"beta"}
    # every written case loads: the document and the truth apply to the stored old file
    for c in sides["heldout_packages"] + sides["train"]:
        doc, after = load_case(out, c)
        assert (after != doc) == (c["truth"] is not None)
    only = _build(
        tmp_path, tmp_path / "only", [Pin("alpha", "2.0"), Pin("beta", "2.0", heldout=True)], held_out_only=True
    )
    assert [p["package"] for p in only["pairs"]] == ["beta"] and not only["counts"]["train"]["total"]


def _real_per_package(summary: dict) -> Counter:
    per: Counter = Counter()
    for side in summary["counts"].values():  # a training package's files fall on both training sides
        for p, c in side["packages"].items():
            per[p] += sum(v for k, v in c.items() if k != "noise")
    return per


def test_cases_are_deterministic_and_capped(tmp_path, monkeypatch):
    pins = [Pin("alpha", "2.0"), Pin("beta", "2.0")]
    full = _build(tmp_path, tmp_path / "full", pins)
    assert _real_per_package(full) == {"alpha": 6, "beta": 6}  # 3 files x 2 cases each
    monkeypatch.setattr(ep, "PER_FILE", 1)
    a = _build(tmp_path, tmp_path / "a", pins)
    b = _build(tmp_path, tmp_path / "b", pins[::-1])
    for side in ep.SIDES:
        assert (tmp_path / "a" / f"{side}.jsonl").read_bytes() == (tmp_path / "b" / f"{side}.jsonl").read_bytes()
    assert a["counts"] == b["counts"] and _real_per_package(a) == {"alpha": 3, "beta": 3}
    assert [(p["package"], p["old"], p["new"]) for p in a["pairs"]] == [("alpha", "1.0", "2.0"), ("beta", "1.0", "2.0")]
    ids = [json.loads(ln)["id"] for ln in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    assert ids == sorted(ids)  # packages, then files, then hunks, top to bottom (one digit here)
    monkeypatch.setattr(ep, "PER_PACKAGE", 2)
    assert _real_per_package(_build(tmp_path, tmp_path / "c", pins)) == {"alpha": 2, "beta": 2}
    _build(tmp_path, tmp_path / "d", pins, max_cases=3)
    train = [json.loads(ln) for ln in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    assert len(train) == 3 and {c["package"] for c in train} == {"alpha", "beta"}  # taken in turn


def test_cli_flag_builds_edits(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "out" / "wheels"
    o, n = _pkg(tmp_path / "src", "alpha", 1, "a")
    _wheel(cache, "alpha", "1.0", o)
    _wheel(cache, "alpha", "2.0", n)
    manifest = tmp_path / "m.txt"
    manifest.write_text("alpha==2.0 heldout\n")
    monkeypatch.setattr(ep, "previous_versions", _versions)
    p = argparse.ArgumentParser()
    add_corpus_args(p)
    args = p.parse_args(["--manifest", str(manifest), "--edits", str(tmp_path / "out"), "--held-out-only"])
    assert run_corpus(args) == 0
    assert "heldout_packages.jsonl" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "edits.json").read_text())
    assert summary["pairs"][0]["old"] == "1.0" and len(summary["pairs"][0]["sha256"][0]) == 64
