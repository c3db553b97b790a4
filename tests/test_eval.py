"""`dlm-lsp eval`: hole cutting (dlm_lsp/measure/holes.py), the metrics, the AR decoder, and a tiny end-to-end run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dlm_lsp.measure.evaluate import (
    METRIC_KEYS,
    OracleFiller,
    Sample,
    edit_similarity,
    evaluate,
    exact_match,
    fim_greedy,
    levenshtein,
    load_files,
    percentile,
    repeats_suffix,
    score,
    syntax_clean,
)
from dlm_lsp.measure.holes import KINDS, Hole, count_syntax_errors, cut_holes, parse
from tests.tiny import make_tiny_checkpoint

SAMPLE = Path(__file__).parent / "data" / "eval_sample.py"


@pytest.fixture(scope="module")
def stdlib_files():
    """A few held-out stdlib files (the eval's default source)."""
    files = load_files(None, limit_files=8)
    assert len(files) == 8
    return files


def _spans(holes):
    return {k: [(h.key, h.a, h.b) for h in v] for k, v in holes.items()}


# ----------------------------------------------------------------------------- hole cutting


def test_holes_are_deterministic_for_a_seed(stdlib_files):
    a = cut_holes(stdlib_files, 30, seed=7)
    b = cut_holes(list(reversed(stdlib_files)), 30, seed=7)  # input order does not matter
    assert _spans(a) == _spans(b)
    assert all(len(a[k]) == 30 for k in KINDS)
    c = cut_holes(stdlib_files, 30, seed=8)
    assert _spans(a) != _spans(c)
    # asking for one kind alone gives that kind's same holes (each kind has its own RNG)
    assert _spans(cut_holes(stdlib_files, 30, seed=7, kinds=("middle",)))["middle"] == _spans(a)["middle"]


def test_holes_do_not_repeat(stdlib_files):
    holes = cut_holes(stdlib_files, 60, seed=0)
    for kind, hs in holes.items():
        spans = [(h.key, h.a, h.b) for h in hs]
        assert len(set(spans)) == len(spans), kind


def test_line_holes_run_to_the_end_of_the_line(stdlib_files):
    for h in cut_holes(stdlib_files, 60, seed=1, kinds=("line",))["line"]:
        assert h.middle.strip() and "\n" not in h.middle
        assert h.suffix == "" or h.suffix.startswith("\n"), (h.key, h.middle, h.suffix[:20])
        line = h.text.split("\n")[h.line]
        indent = len(line) - len(line.lstrip())
        assert 1 <= h.col - indent <= 15, (h.key, h.line, h.col)
        assert not line.lstrip().startswith("#")
        assert h.prefix + h.middle + h.suffix == h.text


def _function_bodies(text: str) -> dict[int, object]:
    """First-statement char offset -> the function_definition's body node."""
    tree = parse(text)
    raw = text.encode()
    out, stack = {}, [tree.root_node]
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        if n.type == "function_definition":
            body = n.child_by_field_name("body")
            first = next(c for c in body.named_children if c.type != "comment")
            out[len(raw[: first.start_byte].decode())] = body
    return out


def test_block_holes_are_whole_function_bodies(stdlib_files):
    holes = cut_holes(stdlib_files, 40, seed=2, kinds=("block",))["block"]
    assert len(holes) >= 20  # these 8 files hold fewer than 40 bodies of 2-8 lines: all of them
    bodies = {}
    for h in holes:
        if h.key not in bodies:
            bodies[h.key] = _function_bodies(h.text)
        assert h.a in bodies[h.key], f"{h.key}:{h.line + 1} does not start a function body"
        body = bodies[h.key][h.a]
        raw = h.text.encode()
        body_end = len(raw[: body.end_byte].decode())
        tail = h.text[body_end : h.b].strip()  # after the body's last statement: nothing or a comment
        assert body_end <= h.b and (tail == "" or tail.startswith("#"))
        assert 2 <= h.middle.count("\n") + 1 <= 8
        # the prefix ends after the header line's newline plus the body's indentation
        head, _, indent = h.prefix.rpartition("\n")
        assert indent.strip() == "" and not h.middle[0].isspace()
        assert head.rstrip().endswith(":") or "#" in head.split("\n")[-1]
        assert h.suffix == "" or h.suffix.startswith("\n")


def test_block_holes_on_a_known_file():
    text = SAMPLE.read_text()
    holes = cut_holes([("sample", text)], 100, seed=0)
    middles = sorted(h.middle for h in holes["block"])
    assert middles == sorted(
        [
            "c = a + b\n    return c",  # two()
            'if y:\n            return os.path.join(y, "a")\n        return None',  # method(), comment on its header
            "await self.method(1)\n        return 2",  # async later()
            "total = first + second\n    return total",  # wrapped(), header over several lines
        ]
    )  # not: one() (one-line def), nine() (9 lines), single() (1 line)


def test_middle_holes_have_code_after_them(stdlib_files):
    for h in cut_holes(stdlib_files, 60, seed=3, kinds=("middle",))["middle"]:
        assert h.middle.strip() and "\n" not in h.middle and 2 <= len(h.middle.encode()) <= 40
        rest = h.suffix.split("\n", 1)[0].strip()
        assert rest and not rest.startswith("#"), (h.key, h.middle, rest)


def test_files_with_syntax_errors_give_no_holes():
    broken = "def f(:\n    x = 1\n    return x\n"
    assert all(not v for v in cut_holes([("bad", broken)], 10).values())
    with pytest.raises(ValueError):
        cut_holes([("ok", "x = 1\n")], 1, kinds=("lines",))


# ----------------------------------------------------------------------------- metrics


def test_edit_distance_and_similarity():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == levenshtein("abc", "") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert edit_similarity("abc", "abc") == 1.0
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("abcd", "abce") == pytest.approx(0.75)
    assert edit_similarity("", "abcd") == 0.0


def test_exact_match_ignores_trailing_whitespace_only():
    assert exact_match("x = 1   \n", "x = 1")
    assert exact_match("if a:  \n    b\n\n", "if a:\n    b")
    assert not exact_match("x = 1", "x = 2")
    assert not exact_match(" x = 1", "x = 1")  # leading whitespace matters


def test_syntax_clean_compares_with_the_original_file():
    text = "def f(a):\n    return a + 1\n"
    h = Hole("block", "t", text, text.index("return"), text.index("\n", text.index("return")))
    assert syntax_clean(h, "return a + 1")
    assert syntax_clean(h, "return a * 2")
    assert not syntax_clean(h, "return (a +")
    assert not syntax_clean(h, "return a +\n  x = 1")
    assert syntax_clean(h, "")  # tree-sitter-python accepts an empty block: no error node
    # a file that already had an error: a fill that adds none is clean
    bad = "x = (\ndef f(a):\n    return a\n"
    base = count_syntax_errors(bad)
    assert base > 0
    hb = Hole("line", "b", bad, bad.index("return") + 7, bad.index("\n", bad.index("return")))
    assert syntax_clean(hb, "a", base)


def test_repeats_suffix():
    assert repeats_suffix("    return x\n", "\n    return x\n")
    assert repeats_suffix("\n\nreturn result", "\n\n    return result  \n")
    assert not repeats_suffix("return y", "\nreturn x\n")
    assert not repeats_suffix("", "\nreturn x")
    assert not repeats_suffix("return x", "\n\n")
    long = "self.assertEqual(result, expected_value_number_one)"
    assert repeats_suffix(long.replace("one", "onf"), "\n" + long)  # one edit in 50 chars: within 5%


def test_percentile():
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_score_on_hand_made_samples():
    text = "def f(a):\n    return a + 1\n\nvalue = f(2)\n"
    a = text.index("return")
    h = Hole("block", "t", text, a, text.index("\n", a))
    perfect = Sample(raw=h.middle, shown=h.middle, ms=10, engine_ms=9, steps=2, tokens=4, server_kind="block")
    broken = Sample(raw="return (a", shown="", ms=30, engine_ms=29, steps=3, tokens=3, server_kind="block")
    dup = Sample(raw="value = f(2)", shown="value = f(2)", ms=20, engine_ms=19, steps=1, tokens=4, server_kind="block")
    r = score([h, h, h], [perfect, broken, dup])
    assert r["holes"] == 3
    assert r["exact"] == pytest.approx(1 / 3, abs=1e-3)
    assert r["syntax_clean"] == pytest.approx(2 / 3, abs=1e-3)  # the broken raw fill adds an error
    assert r["dup_suffix"] == pytest.approx(1 / 3, abs=1e-3)  # the third repeats the next statement
    assert r["p50_ms"] == 20.0
    assert r["empty"] == pytest.approx(1 / 3, abs=1e-3)
    assert 0 < r["edit_sim"] < 1


def test_shown_accepted_and_the_gate_curve():
    from dlm_lsp.measure.evaluate import accept_curve

    text = "def f(a):\n    return a + 1\n\nvalue = f(2)\n"
    a = text.index("return")
    h = Hole("line", "t", text, a, text.index("\n", a))
    right = Sample(
        raw="return a", shown="return a", ms=1, engine_ms=1, steps=1, tokens=2, server_kind="line", confidence=0.9
    )
    wrong = Sample(
        raw="return b", shown="return b", ms=1, engine_ms=1, steps=1, tokens=2, server_kind="line", confidence=0.3
    )
    tiny = Sample(raw="r", shown="r", ms=1, engine_ms=1, steps=1, tokens=1, server_kind="line", confidence=0.95)
    hidden = Sample(
        raw="return a + 1",
        shown="",
        ms=1,
        engine_ms=1,
        steps=1,
        tokens=3,
        server_kind="line",
        confidence=0.1,
        ungated="return a + 1",
    )
    r = score([h] * 4, [right, wrong, tiny, hidden])
    assert r["shown"] == pytest.approx(2 / 4)  # one char is not a shown fill; the gated one is hidden
    assert r["accepted"] == pytest.approx(1 / 2)  # a prefix of the true text counts, "return b" does not
    curve = {p["gate"]: p for p in accept_curve([h] * 4, [right, wrong, tiny, hidden])}
    assert r["accepted_chars"] == pytest.approx(len("return a") / 4)  # kept characters per hole
    assert curve[0.0] == {
        "gate": 0.0,
        "shown": 0.75,
        "accepted": pytest.approx(2 / 3, abs=1e-3),
        "chars": pytest.approx((len("return a") + len("return a + 1")) / 4),
    }
    assert curve[0.5] == {"gate": 0.5, "shown": 0.25, "accepted": 1.0, "chars": 2.0}
    assert curve[1.0]["shown"] == 0.0


def test_oracle_through_the_server_path_scores_high():
    """The true middle through the server's context and post-processing: the pipeline's ceiling."""
    holes = cut_holes([("sample", SAMPLE.read_text())], 4, seed=0)
    res = evaluate(OracleFiller(), holes)
    for kind in KINDS:
        assert res[kind]["holes"] == 4
        assert res[kind]["syntax_clean"] == 1.0 and res[kind]["dup_suffix"] == 0.0
    assert res["block"]["edit_sim"] > 0.5


# ----------------------------------------------------------------------------- AR decoding, end to end


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_models")
    return make_tiny_checkpoint(root / "dlm"), make_tiny_checkpoint(root / "ar", attention="causal", seed=1)


def test_fim_greedy_matches_recomputing_every_token(tiny_models):
    from engine.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX
    from engine.weights.load import load_checkpoint

    model, tok, cfg = load_checkpoint(tiny_models[1])
    prefix, suffix = "def add(a, b):\n    ret", "\n\nfor i in range(10):\n"
    got, healed = fim_greedy(model, tok, prefix, suffix, max_tokens=12)
    assert healed == ""
    seq = [
        tok.token_id(FIM_PREFIX),
        *tok.encode(prefix),
        tok.token_id(FIM_SUFFIX),
        *tok.encode(suffix),
        tok.token_id(FIM_MIDDLE),
    ]
    want = []
    with torch.no_grad():
        for _ in range(12):
            nxt = int(model(torch.tensor([seq + want]))[0, -1].argmax())
            if nxt in (cfg.eos_token_id, cfg.pad_token_id):
                break
            want.append(nxt)
    assert got == want and len(got) > 0


def test_fim_greedy_heals_the_prefix_tail_like_the_diffusion_engine(tiny_models):
    from engine.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX
    from engine.weights.load import load_checkpoint

    model, tok, cfg = load_checkpoint(tiny_models[1])
    prefix, suffix = "import os\nimpo", "\n"
    h = tok.heal(tok.encode(prefix))
    got, healed = fim_greedy(model, tok, prefix, suffix, max_tokens=6, heal=True)
    assert h and healed == h.text and got and got[0] in h.first and tok.decode(got).startswith(h.text)
    seq = [
        tok.token_id(FIM_PREFIX),
        *tok.encode(prefix)[: -h.k],
        tok.token_id(FIM_SUFFIX),
        *tok.encode(suffix),
        tok.token_id(FIM_MIDDLE),
    ]
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[0, -1]
        assert got[0] == max(h.first, key=lambda i: float(logits[i]))  # the best candidate, not the best token
        if got[0] in h.then:  # a piece: the second token completes the tail
            logits = model(torch.tensor([seq + got[:1]]))[0, -1]
            assert got[1] == max(h.then[got[0]], key=lambda i: float(logits[i]))


def test_eval_end_to_end_writes_json_and_markdown(tiny_models, tmp_path):
    from dlm_lsp.cli import main

    dlm, ar = tiny_models
    out, md = tmp_path / "eval.json", tmp_path / "eval.md"
    rc = main(
        [
            "eval",
            "--model",
            str(dlm),
            "--ar-model",
            str(ar),
            "--per-kind",
            "3",
            "--limit-files",
            "6",
            "--threads",
            "1",
            "--json",
            str(out),
            "--md",
            str(md),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(KINDS) | {"meta", "ar"} <= set(res)
    for kind in KINDS:
        for src in (res, res["ar"]):
            r = src[kind]
            assert set(METRIC_KEYS) == {"holes", "exact", "edit_sim", "syntax_clean", "dup_suffix", "p50_ms", "p95_ms"}
            assert set(METRIC_KEYS) <= set(r)
            assert r["holes"] == 3
            assert all(0.0 <= r[k] <= 1.0 for k in ("exact", "edit_sim", "syntax_clean", "dup_suffix"))
            assert 0 < r["p50_ms"] <= r["p95_ms"]
    meta = res["meta"]
    assert meta["seed"] == 0 and meta["counts"] == {k: 3 for k in KINDS} and meta["files"] == 6
    assert meta["model"] == str(dlm) and "threshold" in meta["decode"]
    assert all(0.0 <= res[k]["shown"] <= 1.0 and 0.0 <= res[k]["accepted"] <= 1.0 for k in KINDS)
    assert [p["gate"] for p in res["line"]["curve"]][:3] == [0.0, 0.05, 0.1]
    table = md.read_text()
    assert table.startswith("| model | kind |") and table.count("\n") == 2 + 6


def test_eval_on_a_source_folder(tiny_models, tmp_path):
    from dlm_lsp.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "sample.py").write_text(SAMPLE.read_text())
    out = tmp_path / "e.json"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_models[0]),
                "--source",
                str(src),
                "--per-kind",
                "2",
                "--kinds",
                "block",
                "--json",
                str(out),
                "--decode",
                '{"pad_left": false, "threshold": 0.8}',
                "--min-confidence",
                "0.5",
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["block"]["holes"] == 2 and "line" not in res and res["meta"]["files"] == 1
    assert res["meta"]["decode"]["pad_left"] is False and res["meta"]["decode"]["threshold"] == 0.8
    assert res["meta"]["min_confidence"] == 0.5
    assert main(["eval", "--model", str(tiny_models[0]), "--source", str(src), "--decode", '{"nope": 1}']) == 2


def test_eval_on_a_built_corpus_heldout_packages(tiny_models, tmp_path):
    from dlm_lsp.cli import main

    folder = tmp_path / "corpus"
    (folder / "files" / "pkg" / "pkg").mkdir(parents=True)
    (folder / "files" / "pkg" / "pkg" / "mod.py").write_text(SAMPLE.read_text())
    (folder / "corpus.json").write_text(
        json.dumps({"train": [], "heldout": [], "heldout_packages": ["pkg:pkg/mod.py"]})
    )
    out, png = tmp_path / "e.json", tmp_path / "curve.png"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_models[0]),
                "--corpus",
                str(folder),
                "--heldout",
                "packages",
                "--per-kind",
                "2",
                "--kinds",
                "line",
                "--json",
                str(out),
                "--curve",
                str(png),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["line"]["holes"] == 2 and res["meta"]["files"] == 1 and "packages" in res["meta"]["source"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the held-out files side of this corpus is empty: nothing to cut holes from
    assert main(["eval", "--model", str(tiny_models[0]), "--corpus", str(folder), "--heldout", "files"]) == 1


def test_decode_options_overrides():
    from engine.api import DecodeOptions, decode_options

    assert decode_options(None) == DecodeOptions()
    assert decode_options('{"block": 4}').block == 4 and decode_options({"steps": 3}).steps == 3
    for bad in ('{"nope": 1}', "[1]", "{"):
        with pytest.raises(ValueError):
            decode_options(bad)


def test_eval_oracle_only_loads_no_model(tmp_path):
    from dlm_lsp.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "sample.py").write_text(SAMPLE.read_text())
    out, samples = tmp_path / "o.json", tmp_path / "s.jsonl"
    assert (
        main(
            [
                "eval",
                "--oracle-only",
                "--model",
                str(tmp_path / "no-such-model"),
                "--source",
                str(src),
                "--per-kind",
                "2",
                "--json",
                str(out),
                "--samples",
                str(samples),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["meta"]["oracle_only"] and all(res[k]["holes"] == 2 for k in KINDS)
    rows = [json.loads(ln) for ln in samples.read_text().splitlines()]
    assert len(rows) == 2 * len(KINDS) and {r["model"] for r in rows} == {"oracle"}


def test_fim_greedy_keeps_the_prompt_inside_the_twins_training_window(tiny_models, monkeypatch):
    import engine.decode.autoregressive as ar
    from engine.weights.load import load_checkpoint

    model, tok, cfg = load_checkpoint(tiny_models[1])
    cfg.context_len = 96
    seen = []
    real = ar.greedy_decode

    def spy(m, prompt, n, **kw):
        seen.append(len(prompt))
        return real(m, prompt, n, **kw)

    monkeypatch.setattr(ar, "greedy_decode", spy)
    fim_greedy(model, tok, "x = 1\n" * 200, "y = 2\n" * 200, max_tokens=8)
    assert seen and seen[0] + 8 <= 96


def test_reuse_typing_types_the_last_characters_then_fills_the_hole_with_reuse():
    """--reuse-typing N: the last N characters before the cursor are typed back one at a time, each a
    fill under the hole's session key with reuse on; the scored fill is the hole's own request."""
    import types

    from dlm_lsp.measure.evaluate import TypedReuseFiller
    from engine.api import DecodeOptions, Fill
    from engine.decode.reuse import ReuseCache

    class Recorder:
        _reuse = ReuseCache()

        def __init__(self):
            self.jobs = []

        def run_now(self, job):
            self.jobs.append(job)
            return Fill(
                text="x", tokens=1, steps=1, slots=job.max_tokens, reused_tokens=len(self.jobs) - 1, forwarded_tokens=5
            )

    rec = Recorder()
    base = types.SimpleNamespace(service=rec, budget_ms=None, min_confidence=0.0, options=DecodeOptions(threshold=0.7))
    typed = TypedReuseFiller(base, typing=3)
    text = "def f(a, b):\n    total = a + b\n    return total\n"
    a = text.index("a + b")
    hole = Hole("line", "t:x.py", text, a, text.index("\n", a))
    for _ in range(2):
        rec.jobs.clear()
        sample = typed(hole)
        assert len(rec.jobs) == 4  # three keystrokes, then the hole's own request
        for k, j in zip((3, 2, 1, 0), rec.jobs):  # one character more each keystroke, the rest of the line after it
            assert j.prefix.endswith(text[a - k - 10 : a - k]) and "return total" in j.suffix
        assert all(j.options.reuse and j.options.threshold == 0.7 for j in rec.jobs)
        assert len({j.session for j in rec.jobs}) == 1 and sample.raw == "x"
    assert rec.jobs[0].session != "eval-reuse-1"  # the second hole typed under a session of its own
    s = typed.summary()
    assert s["typing"] == 3 and s["scored_fills"] == 2 and s["reused_tokens_mean"] == 3.0 and s["reused_share"] == 1.0


def test_eval_reuse_typing_end_to_end(tiny_models, tmp_path):
    from dlm_lsp.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "sample.py").write_text(SAMPLE.read_text())
    out, md = tmp_path / "e.json", tmp_path / "e.md"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_models[0]),
                "--source",
                str(src),
                "--per-kind",
                "2",
                "--kinds",
                "line",
                "--threads",
                "1",
                "--reuse-typing",
                "2",
                "--json",
                str(out),
                "--md",
                str(md),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    r = res["reuse"]
    assert r["line"]["holes"] == res["line"]["holes"] == 2 and r["typing"] == 2 and r["scored_fills"] == 2
    assert r["outcomes"]["full_new"] == 2 and sum(r["outcomes"].values()) == 2 * 3  # a session per hole, 3 fills each
    assert 0 <= r["same_raw_share"] <= 1 and 0 <= r["same_shown_share"] <= 1 and 0 <= r["reused_share"] <= 1
    assert "| diffusion+reuse | line | 2 |" in md.read_text()


def test_eval_gives_each_package_a_workspace_memory_and_its_jobs_name_it(tiny_models, tmp_path, monkeypatch):
    """--retrieve package: each held-out package's files go to the engine as one workspace memory
    (named after the package) and every job names it and its own file, which the engine leaves out."""
    from dlm_lsp.cli import main
    from engine.serve.service import EngineService

    folder = tmp_path / "corpus"
    keys = []
    for pkg in ("p", "q"):
        for name in ("a", "b"):
            (folder / "files" / pkg / pkg).mkdir(parents=True, exist_ok=True)
            (folder / "files" / pkg / pkg / f"{name}.py").write_text(SAMPLE.read_text())
            keys.append(f"{pkg}:{pkg}/{name}.py")
    (folder / "corpus.json").write_text(json.dumps({"train": [], "heldout": [], "heldout_packages": keys}))
    spaces, jobs = {}, []
    real_run = EngineService.run_now

    def capture(self, space, files):
        spaces[space] = sorted(files)
        return {"files": len(files), "tokens": 0, "refused": 0}

    monkeypatch.setattr(EngineService, "workspace_files", capture)
    monkeypatch.setattr(EngineService, "run_now", lambda self, job: (jobs.append(job), real_run(self, job))[1])
    out = tmp_path / "e.json"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_models[0]),
                "--corpus",
                str(folder),
                "--heldout",
                "packages",
                "--retrieve",
                "package",
                "--per-kind",
                "4",
                "--kinds",
                "line",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert spaces == {"p:p": ["p:p/a.py", "p:p/b.py"], "q:q": ["q:q/a.py", "q:q/b.py"]}
    assert jobs and all(j.workspace == j.document.split("/", 1)[0] and j.document in keys for j in jobs)
    assert json.loads(out.read_text())["meta"]["workspace_ngram_memory"] is True
    jobs.clear()
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_models[0]),
                "--corpus",
                str(folder),
                "--heldout",
                "packages",
                "--per-kind",
                "2",
                "--kinds",
                "line",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert (
        jobs
        and all(j.workspace is None for j in jobs)
        and not json.loads(out.read_text())["meta"]["workspace_ngram_memory"]
    )


# ----------------------------------------------------------------------------- strict acceptance (issue 38)


@pytest.mark.parametrize(
    ("fill", "ok"),
    [
        ("", False),
        ('""', False),  # an empty string literal: no letter or digit
        ("(", False),
        (":", False),
        ("):", False),
        ("if", False),  # a keyword shorter than 3 non-space characters
        ("x", False),
        ("  x ", False),
        ("...", False),
        ("foo", True),
        ("return x", True),
        (" # We", True),  # "#We": 3 non-space characters, letters among them
        ("x)", False),
        ("x):", True),
        ("42)", True),
    ],
)
def test_the_strict_rule_needs_a_letter_or_digit_and_three_non_space_characters(fill, ok):
    from dlm_lsp.measure.evaluate import strictly_accepted, substantial

    assert substantial(fill) is ok
    # with a true text that starts with the fill, strictly accepted is the same rule
    h = Hole("line", "t", "a = 1\n" + fill + "\n", len("a = 1\n"), len("a = 1\n" + fill))
    assert strictly_accepted(h, fill, 0) is ok
    if ok:  # and never where the true text does not start with it (today's rule, _accepted)
        assert not strictly_accepted(Hole("line", "t", "a = 1\nzzz\n", 6, 9), fill, 0)


def _strict_holes_and_samples():
    text1 = "def f(a):\n    return a + 1\n\nvalue = f(2)\n"
    a1 = text1.index("return")
    h1 = Hole("line", "t1", text1, a1, text1.index("\n", a1))  # middle "return a + 1"
    text2 = 'value = foo("", x)\n'
    h2 = Hole("middle", "t2", text2, text2.index("("), text2.index("\n"))  # middle '("", x)'

    def fill(text, conf):
        return Sample(raw=text, shown=text, ms=1, engine_ms=1, steps=1, tokens=1, server_kind="line", confidence=conf)

    return [h1, h1, h2, h2, h1], [
        fill("return a", 0.9),  # accepted, strict: 8 chars
        fill("re", 0.8),  # accepted, too short for strict
        fill('(""', 0.7),  # accepted, no letter or digit
        fill('("", x', 0.2),  # accepted, strict: 6 chars
        fill("return b", 0.95),  # not accepted
    ]


def test_strict_and_strict_chars_on_synthetic_holes():
    from dlm_lsp.measure.evaluate import accept_curve, overall

    holes, samples = _strict_holes_and_samples()
    r = score(holes, samples)
    assert r["shown"] == 1.0 and r["accepted"] == pytest.approx(4 / 5)
    assert r["accepted_chars"] == pytest.approx((8 + 2 + 3 + 6) / 5)
    assert r["strict"] == pytest.approx(2 / 5)  # of the shown fills
    assert r["strict_chars"] == pytest.approx((8 + 6) / 5)  # per hole
    # a hidden or one-character fill is not shown, so it is neither accepted nor strict
    hidden = dataclasses.replace(samples[0], shown="", ungated="return a")
    tiny = dataclasses.replace(samples[0], shown="r", raw="r")
    r2 = score([holes[0]] * 3, [hidden, tiny, samples[0]])
    assert r2["shown"] == pytest.approx(1 / 3, abs=1e-3) and r2["strict"] == 1.0
    assert r2["strict_chars"] == pytest.approx(8 / 3, abs=1e-3)

    curve = {p["gate"]: p for p in accept_curve(holes, samples, strict=True)}
    assert curve[0.0]["strict"] == pytest.approx(r["strict"]) and curve[0.0]["strict_chars"] == r["strict_chars"]
    assert curve[0.5] == {
        "gate": 0.5,
        "shown": 0.8,
        "accepted": 0.75,
        "chars": pytest.approx((8 + 2 + 3) / 5, abs=1e-3),
        "strict": 0.25,
        "strict_chars": pytest.approx(8 / 5, abs=1e-3),
    }
    assert curve[0.85]["strict"] == 0.5  # "return a" and "return b" are left
    assert curve[1.0]["shown"] == 0.0 and curve[1.0]["strict"] == 0.0 and curve[1.0]["strict_chars"] == 0.0
    assert "strict" not in accept_curve(holes, samples)[0]  # the plain curve keeps its four keys

    every = overall(holes + [holes[0]] * 3, samples + [hidden, tiny, samples[0]])
    assert every["holes"] == 8 and every["shown"] == pytest.approx(6 / 8)
    assert every["strict"] == pytest.approx(3 / 6) and every["strict_chars"] == pytest.approx((8 + 6 + 8) / 8, abs=1e-3)
    assert every["curve"][0]["strict_chars"] == pytest.approx((8 + 6 + 8 + 8) / 8, abs=1e-3)  # the ungated fills


def test_pick_gate_maximizes_strict_chars_and_checks_the_floor():
    from dlm_lsp.measure.evaluate import STRICT_FLOOR, gate_lines, gate_summary, pick_gate

    def pt(gate, shown, accepted, strict, strict_chars):
        return {
            "gate": gate,
            "shown": shown,
            "accepted": accepted,
            "chars": 0.0,
            "strict": strict,
            "strict_chars": strict_chars,
        }

    curve = [
        pt(0.0, 0.8, 0.40, 0.20, 1.10),
        pt(0.1, 0.6, 0.50, 0.30, 1.40),
        pt(0.2, 0.4, 0.55, 0.38, 1.40),  # as many characters, a higher gate: the first (0.1) is kept
        pt(0.3, 0.2, 0.60, 0.45, 0.90),
        pt(0.4, 0.0, 0.00, 0.90, 0.00),  # shows nothing: never reaches the floor
    ]
    g = pick_gate(curve)
    assert STRICT_FLOOR == 0.40
    assert (g["gate"], g["shown"], g["accepted"], g["strict"], g["strict_chars"]) == (0.1, 0.6, 0.5, 0.3, 1.4)
    assert g["passes"] is True and g["floor_gate"] == 0.3 and g["floor_shown"] == 0.2 and g["best_strict"] == 0.45
    g = pick_gate(curve, floor=0.5)
    assert g["gate"] == 0.1 and g["passes"] is False and g["floor_gate"] is None and g["floor_shown"] == 0.0
    assert g["best_strict"] == 0.45
    # nothing shown at any gate: the first gate, failing
    g = pick_gate([pt(0.0, 0.0, 0.0, 0.0, 0.0), pt(0.5, 0.0, 0.0, 0.0, 0.0)])
    assert g["gate"] == 0.0 and g["passes"] is False and g["best_strict"] == 0.0

    holes, samples = _strict_holes_and_samples()
    gates = gate_summary({"line": {**score(holes, samples), "curve": curve}, "meta": {"seed": 0}})
    assert list(gates) == ["line"] and gates["line"]["gate"] == 0.1
    (line,) = gate_lines("diffusion", gates)
    assert (
        line.startswith("[gates diffusion] line")
        and "best gate 0.1" in line
        and "pass from gate 0.3 (shown 0.200)" in line
    )
    assert "fail (best 0.450)" in gate_lines("m", {"line": pick_gate(curve, floor=0.5)})[0]


def test_eval_writes_strict_per_sample_and_overall():
    import io

    from dlm_lsp.measure.evaluate import _shown, markdown_table

    holes = cut_holes([("sample", SAMPLE.read_text())], 4, seed=0)
    out = io.StringIO()
    res = evaluate(OracleFiller(), holes, "oracle", out)
    rows = [json.loads(ln) for ln in out.getvalue().splitlines()]
    assert all(isinstance(r["strict"], bool) for r in rows)
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        shown = [r for r in mine if _shown(r["shown"])]
        assert res[kind]["strict"] == pytest.approx(sum(r["strict"] for r in shown) / max(1, len(shown)), abs=1e-4)
        chars = sum(len(r["shown"].rstrip()) for r in mine if r["strict"])
        assert res[kind]["strict_chars"] == pytest.approx(chars / len(mine), abs=1e-3)
        assert all(r["kept_chars"] for r in mine if r["strict"])  # strict is a part of accepted
        assert {"strict", "strict_chars"} <= set(res[kind]["curve"][0])
    assert res["all"]["holes"] == len(rows) == 12
    assert res["all"]["strict"] == pytest.approx(
        sum(r["strict"] for r in rows) / sum(_shown(r["shown"]) for r in rows), abs=1e-4
    )
    table = markdown_table({"oracle": res}).splitlines()
    assert table[0].endswith("| p50 ms | p95 ms | strict | strict chars |") and len(table) == 2 + 3
    assert all(row.count("|") == 14 for row in table)
    assert table[2].endswith(f"| {res['line']['strict']:.3f} | {res['line']['strict_chars']:.2f} |")
    assert "all" not in evaluate(OracleFiller(), {"line": holes["line"]})  # one kind: no "all"
