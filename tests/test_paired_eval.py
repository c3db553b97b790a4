"""dlm_lsp/measure/paired.py (`dlm-lsp paired`): two eval --samples runs on the same holes, compared hole
by hole; and the samples' own "exact" / "kept_chars" fields, which must agree with the eval's scored tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlm_lsp.measure import paired as pe
from dlm_lsp.measure.holes import KINDS

SAMPLE = Path(__file__).parent / "data" / "eval_sample.py"


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory):
    from dlm_lsp.cli import main

    tmp = tmp_path_factory.mktemp("paired")
    (tmp / "src").mkdir()
    (tmp / "src" / "sample.py").write_text(SAMPLE.read_text())
    out, samples = tmp / "o.json", tmp / "a.jsonl"
    assert (
        main(
            [
                "eval",
                "--oracle-only",
                "--source",
                str(tmp / "src"),
                "--per-kind",
                "6",
                "--json",
                str(out),
                "--samples",
                str(samples),
            ]
        )
        == 0
    )
    return tmp, json.loads(out.read_text()), [json.loads(ln) for ln in samples.read_text().splitlines()]


def test_the_samples_fields_agree_with_the_scored_tables(oracle_run):
    _, res, rows = oracle_run
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        assert len(mine) == res[kind]["holes"] > 0
        assert sum(r["exact"] for r in mine) / len(mine) == pytest.approx(res[kind]["exact"], abs=1e-4)
        assert sum(r["kept_chars"] for r in mine) / len(mine) == pytest.approx(res[kind]["accepted_chars"], abs=1e-3)
    assert any(r["kept_chars"] for r in rows)


def test_a_pair_is_compared_hole_by_hole_and_pooled_per_kind(oracle_run):
    tmp, _, rows = oracle_run
    a = tmp / "a.jsonl"
    worse = [dict(r) for r in rows]
    hit = [i for i, r in enumerate(worse) if r["kind"] == "line" and r["exact"] and r["kept_chars"]][:3]
    assert len(hit) == 3
    for i in hit:  # three line holes lost: nothing shown there
        worse[i].update(shown="", exact=False, kept_chars=0)
    b = tmp / "b.jsonl"
    b.write_text("".join(json.dumps(r) + "\n" for r in worse))
    res = pe.compare([(str(a), str(b)), (str(a), str(a))])  # two pairs pooled: 12 holes per kind
    line = res["line"]
    assert line["holes"] == 12 and (line["won"], line["lost"]) == (0, 3)
    assert line["exact_a"] - line["exact_b"] == 3
    lost_chars = sum(rows[i]["kept_chars"] for i in hit)
    assert line["kept_diff"] == pytest.approx(-lost_chars / 12, abs=1e-3) and line["kept_diff_se"] > 0
    assert res["block"]["kept_diff"] == 0 and res["block"]["won"] == res["block"]["lost"] == 0
    # reversed, the same holes count as won
    assert pe.compare([(str(b), str(a))])["line"]["won"] == 3
    # the command: a table, and --json
    out = tmp / "cmp.json"
    assert pe.main([f"{a}:{b}", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["by_kind"]["line"]["lost"] == 3
    # the same command as `dlm-lsp paired`
    from dlm_lsp.cli import main

    out2 = tmp / "cmp2.json"
    assert main(["paired", f"{a}:{b}", "--json", str(out2)]) == 0
    assert json.loads(out2.read_text()) == json.loads(out.read_text())


def test_samples_without_the_fields_fall_back_and_other_holes_are_refused(oracle_run):
    tmp, _, rows = oracle_run
    old = [{k: v for k, v in r.items() if k not in ("exact", "kept_chars")} for r in rows]
    p = tmp / "old.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in old))
    res = pe.compare([(str(tmp / "a.jsonl"), str(p))])
    for kind in KINDS:  # the oracle's fills are the middle itself: the same either way
        assert res[kind]["kept_diff"] == 0 and res[kind]["exact_a"] == res[kind]["exact_b"]
    other = tmp / "other.jsonl"
    other.write_text("".join(json.dumps(dict(r, line=r["line"] + 1)) + "\n" for r in rows))
    with pytest.raises(ValueError, match="not the same holes"):
        pe.compare([(str(tmp / "a.jsonl"), str(other))])
    short = tmp / "short.jsonl"
    short.write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    assert pe.main([f"{tmp / 'a.jsonl'}:{short}"]) == 2
    with pytest.raises(SystemExit):
        pe.main(["no-colon.jsonl"])
