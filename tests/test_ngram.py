"""The corpus n-gram memory (engine/bias/ngram.py, DecodeOptions.ngram): its counting against a plain
counter, its file (safetensors, checked, tied to the tokenizer), and its place in decoding (the
service's fills equal the oracle's; the model's per-kind setting)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict

import numpy as np
import pytest

from dlm_lsp.cli import main as cli
from engine.api import DecodeOptions, EngineError, FillJob, with_model_defaults
from engine.bias import ngram
from engine.clients import wire
from engine.decode import reference
from engine.decode.canvas import check_options
from engine.weights.checkpoint import serving_defaults
from tests.tiny import CORPUS, make_tiny_checkpoint


def brute(stream: list[int], pkgs: list[int], k: int, min_count: int, top: int, min_packages: int) -> dict:
    """context tuple -> [(next, P)] by the table's rules, counted plainly (-1 separates files)."""
    seen, where = defaultdict(Counter), defaultdict(set)
    for i in range(k, len(stream)):
        ctx, nxt = tuple(stream[i - k : i]), stream[i]
        if nxt < 0 or min(ctx) < 0:
            continue
        seen[ctx][nxt] += 1
        where[ctx, nxt].add(pkgs[i])
    out = {}
    for ctx, cnt in seen.items():
        tot = sum(cnt.values())
        kept = sorted((t for t in cnt if len(where[ctx, t]) >= min_packages), key=lambda t: (-cnt[t], t))[:top]
        if tot >= min_count and kept:
            out[ctx] = [(t, cnt[t] / tot) for t in kept]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_count_order_equals_a_plain_counter(seed):
    rng = np.random.default_rng(seed)
    files = [(rng.integers(0, 4, size=rng.integers(3, 60)).tolist(), int(rng.integers(0, 3))) for _ in range(30)]
    stream, pkgs = [], []
    for ids, p in files:
        stream += ids + [-1]
        pkgs += [p] * (len(ids) + 1)
    a, pk = np.array(stream, dtype=np.int64), np.array(pkgs, dtype=np.int64)
    for k, min_count, top, min_packages in [(1, 1, 3, 1), (2, 3, 2, 2), (3, 2, 1, 2), (4, 3, 2, 1)]:
        want = brute(stream, pkgs, k, min_count, top, min_packages)
        hashes, nxt, prob = ngram.count_order(a, pk, k, min_count, top, min_packages)
        got = {}
        for h, row, p in zip(hashes.tolist(), nxt.tolist(), prob.tolist()):
            got[h] = [(t, q) for t, q in zip(row, p) if t >= 0]
        assert set(got) == {ngram.context_hash(c) for c in want}, (k, min_count, top, min_packages)
        for ctx, pairs in want.items():
            g = got[ngram.context_hash(ctx)]
            assert [t for t, _ in g] == [t for t, _ in pairs]
            assert np.allclose([q for _, q in g], [q for _, q in pairs])


def _table() -> ngram.NgramTable:
    runs = {(5, 6, 7, 8): ([9, 10], [0.5, 0.25]), (6, 7, 8): ([11, -1], [0.75, 0.0]), (1, 2, 3): ([4, -1], [1.0, 0.0])}
    items = sorted((ngram.context_hash(c), n, p) for c, (n, p) in runs.items())
    return ngram.NgramTable(
        np.array([h for h, _, _ in items], dtype=np.uint64),
        np.array([n for _, n, _ in items]),
        np.array([p for _, _, p in items], dtype=np.float32),
        (3, 4),
    )


def test_the_longest_stored_context_gives_the_bias_and_ends_break_runs():
    t = _table()
    ids, p = t.next_probs((0, 5, 6, 7, 8))  # the 4-token context wins over its 3-token tail
    assert ids.tolist() == [9, 10] and np.allclose(p, [0.5, 0.25])
    assert t.next_probs((0, 6, 7, 8))[0].tolist() == [11]
    assert t.next_probs((7, 8)) is None and t.next_probs((9, 9, 9)) is None
    import torch

    b = t.add_bias(torch.zeros(5, 16), [(5, 6, 7, 8), (1, 2, 3), (6, 7, 8), (2, 3), (0, 2, 1, 2, 3)], 4.0, skip=(0,))
    assert b[0, 9] == 2.0 and b[0, 10] == 1.0 and b[0].count_nonzero() == 2
    assert b[1, 4] == 4.0 and b[2, 11] == 3.0
    assert b[3].count_nonzero() == 0  # too short for any stored context
    assert b[4].count_nonzero() == 0  # a run holding a skipped id (padding, end, mask) gains nothing
    with pytest.raises(ngram.NgramError, match="sorted"):
        ngram.NgramTable(t.ctx[::-1].copy(), t.nxt, t.prob, (3, 4))


def test_the_file_round_trips_and_is_refused_when_bad_or_for_another_tokenizer(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "m")
    assert ngram.load_table(folder) is None  # no table: the memory is simply absent
    t = _table()
    t.save(folder / ngram.NGRAM_FILE, ngram.tokenizer_digest(folder))
    back = ngram.load_table(folder)
    assert back.orders == (4, 3) and np.array_equal(back.ctx, t.ctx) and np.array_equal(back.nxt, t.nxt)
    assert np.allclose(back.prob, t.prob, atol=1e-3)
    t.save(folder / ngram.NGRAM_FILE, "0" * 64)
    with pytest.raises(ngram.NgramError, match="another tokenizer"):
        ngram.load_table(folder)
    from safetensors.numpy import save_file

    save_file(
        {"ctx": t.ctx.astype(np.int64), "next": t.nxt, "prob": t.prob},
        str(folder / ngram.NGRAM_FILE),
        metadata={"tokenizer_sha256": ngram.tokenizer_digest(folder), "orders": "[3, 4]"},
    )
    with pytest.raises(ngram.NgramError, match="'I64'"):  # the header is checked before safetensors parses it
        ngram.load_table(folder)
    save_file(
        {"ctx": t.ctx, "prob": t.prob},
        str(folder / ngram.NGRAM_FILE),
        metadata={"tokenizer_sha256": ngram.tokenizer_digest(folder), "orders": "[3, 4]"},
    )
    with pytest.raises(ngram.NgramError, match="expected tensors"):
        ngram.load_table(folder)
    save_file(
        {"ctx": t.ctx, "next": t.prob.astype(np.float16), "prob": t.prob},
        str(folder / ngram.NGRAM_FILE),
        metadata={"tokenizer_sha256": ngram.tokenizer_digest(folder), "orders": "[3, 4]"},
    )
    with pytest.raises(ngram.NgramError, match="expected tensors"):  # ids stored as floats
        ngram.load_table(folder)
    t.save(folder / ngram.NGRAM_FILE, ngram.tokenizer_digest(folder))
    raw = (folder / ngram.NGRAM_FILE).read_bytes()
    (folder / ngram.NGRAM_FILE).write_bytes(raw[:-10])
    with pytest.raises(ngram.NgramError, match="truncated"):
        ngram.load_table(folder)
    (folder / ngram.NGRAM_FILE).write_bytes(b"\x80\x03pickle" * 4)
    with pytest.raises(ngram.NgramError, match=ngram.NGRAM_FILE):
        ngram.load_table(folder)


def _corpus(folder) -> str:
    """A two-package corpus of the tiny tokenizer's texts (a continuation counts from 2 packages)."""
    keys = []
    for pkg in ("alpha", "beta"):
        for i, text in enumerate(dict.fromkeys(CORPUS)):
            p = folder / "files" / pkg / f"f{i}.py"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text * 3)
            keys.append(f"{pkg}:f{i}.py")
    (folder / "corpus.json").write_text(json.dumps({"train": keys, "heldout": [], "heldout_packages": []}))
    return str(folder)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from engine.serve.service import EngineService

    root = tmp_path_factory.mktemp("ngram")
    folder = make_tiny_checkpoint(root / "m", seed=5)
    assert (
        cli(
            [
                "ngram",
                "--corpus",
                _corpus(root / "corpus"),
                "--model",
                str(folder),
                "--orders",
                "2,3,4",
                "--min-count",
                "2",
            ]
        )
        == 0
    )
    svc = EngineService(str(folder), device="cpu", threads=1)
    svc.load()
    return svc


def test_the_command_writes_a_table_the_service_loads(served):
    assert served.ngram is not None and len(served.ngram) > 20 and served.ngram.orders == (4, 3, 2)
    ids = served.tok.encode("def add(a, b):\n    return a")
    hit = next(
        served.ngram.next_probs(tuple(ids[: i + 1]))
        for i in range(len(ids) - 1, 0, -1)
        if served.ngram.next_probs(tuple(ids[: i + 1])) is not None
    )
    assert hit[0].size >= 1 and 0 < hit[1].sum() <= 1.0


CASES = [
    ("def add(a, b):\n    return ", "\n"),
    ("import os\nimport ", ""),
    ("for i in range(10):\n    ", ""),
    ("class Point:\n    def __init__(self, x, y):\n        self.", "\n"),
]


@pytest.mark.parametrize(
    "extra",
    [
        dict(cache=False, window=0),
        dict(cache=True, refresh_every=1, window=3, copy_bigram=1.0, copy_order=2),
        dict(cache=True, refresh_every=1, window=16, heal=True),
    ],
)
def test_service_fills_with_the_memory_equal_the_oracle_and_it_changes_fills(served, extra):
    base = DecodeOptions(threshold=0.5, heal=False, ngram=0.0, **{k: v for k, v in extra.items() if k != "heal"})
    base = dataclasses.replace(base, heal=extra.get("heal", False))
    changed = 0
    for prefix, suffix in CASES:
        on = dataclasses.replace(base, ngram=6.0)
        got = served.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=on))
        p_ids, s_ids = served.tok.encode_batch([prefix, suffix])
        heal = served.tok.heal(p_ids) if on.heal else None
        if heal:
            p_ids = p_ids[: -heal.k]
        want = reference.reference_fill(
            served.model,
            p_ids,
            s_ids,
            8 + (1 if heal else 0),
            on,
            ngram=served.ngram,
            heal=heal and heal.first,
            heal_then=heal and heal.then,
        )
        assert got.token_ids == [t for t in want][: len(got.token_ids)] and len(got.token_ids) == len(want)
        off = served.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=base))
        changed += got.token_ids != off.token_ids
    assert changed  # the memory reached the slots


def test_the_models_per_kind_setting_and_the_missing_table(served, tmp_path):
    (tmp_path / "serving.json").write_text('{"decode": {"ngram": 20, "ngram_kinds": {"block": 0, "middle": 8}}}')
    tuned = serving_defaults(tmp_path)["decode"]
    assert tuned == {"ngram": 20.0, "ngram_kinds": {"block": 0.0, "middle": 8.0}}
    assert with_model_defaults(DecodeOptions(), tuned, "line").ngram == 20.0
    assert with_model_defaults(DecodeOptions(), tuned, "block").ngram == 0.0
    assert with_model_defaults(DecodeOptions(), tuned, "middle").ngram == 8.0
    assert with_model_defaults(DecodeOptions(ngram=3.0), tuned, "block").ngram == 3.0  # an explicit setting wins
    assert with_model_defaults(DecodeOptions(), {}).ngram == 0.0
    for bad in ('{"decode": {"ngram": -1}}', '{"decode": {"ngram": 80}}', '{"decode": {"ngram_kinds": {"line": "x"}}}'):
        (tmp_path / "serving.json").write_text(bad)
        assert serving_defaults(tmp_path) == {}
    with pytest.raises(EngineError, match="ngram"):
        served.run_now(FillJob(prefix="x = ", options=DecodeOptions(ngram=-1.0)))
    table, served.ngram = served.ngram, None
    try:
        with pytest.raises(EngineError, match="no n-gram table"):  # asked for explicitly: a clear error
            served.run_now(FillJob(prefix="x = ", max_tokens=4, options=DecodeOptions(ngram=5.0)))
        served.serving = {"decode": {"ngram": 5.0}}  # the model's own setting, its table gone: off, not an error
        assert served.run_now(FillJob(prefix="x = ", max_tokens=4)).token_ids is not None
    finally:
        served.ngram, served.serving = table, {}


def test_the_hole_kind_reaches_the_engine():
    from dlm_lsp.fill.context import build_request, to_fill_job
    from dlm_lsp.fill.documents import Document

    req = build_request(Document("file:///t.py", "python", 1, "def f(x):\n    return x\n"), 17)
    job = to_fill_job(req, None)
    assert job.kind == req.hole_kind is not None
    msg = wire.job_message(job)
    assert wire.job_from_message(msg).kind == req.hole_kind
    assert wire.job_from_message({k: v for k, v in msg.items() if k != "kind"}).kind is None
    with pytest.raises(ValueError, match="kind"):
        wire.job_from_message({**msg, "kind": 3})


def test_the_reorder_layout_takes_the_memory_as_the_oracle_does(tmp_path):
    from engine.serve.service import EngineService

    folder = make_tiny_checkpoint(tmp_path / "r", attention="causal", canvas="reorder", seed=2)
    assert (
        cli(
            [
                "ngram",
                "--corpus",
                _corpus(tmp_path / "corpus"),
                "--model",
                str(folder),
                "--orders",
                "2,3",
                "--min-count",
                "2",
            ]
        )
        == 0
    )
    svc = EngineService(str(folder), device="cpu", threads=1)
    svc.load()
    changed = 0
    for prefix, suffix in CASES:
        on = DecodeOptions(threshold=0.5, heal=False, ngram=6.0)
        got = svc.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=6, options=on))
        p_ids, s_ids = svc.tok.encode_batch([prefix, suffix])
        assert got.token_ids == reference.reference_fill(svc.model, p_ids, s_ids, 6, on, ngram=svc.ngram)
        off = svc.run_now(
            FillJob(prefix=prefix, suffix=suffix, max_tokens=6, options=dataclasses.replace(on, ngram=0.0))
        )
        changed += got.token_ids != off.token_ids
    assert changed
    lookup = "def add(a, b):\n    return a + b\n" * 3
    for prefix, suffix in CASES:  # the fill's own n-gram, the same way
        own = DecodeOptions(threshold=0.5, heal=False, ngram=0.0, local_ngram=8.0)
        got = svc.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=6, options=own, lookup=lookup))
        p_ids, s_ids = svc.tok.encode_batch([prefix, suffix])
        assert got.token_ids == reference.reference_fill(svc.model, p_ids, s_ids, 6, own, lookup=svc.tok.encode(lookup))


# ---------------------------------------------------------------- the fill's own n-gram (LocalNgram)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_local_ngram_equals_the_corpus_rule_counted_plainly(seed):
    """LocalNgram.next_probs is the corpus table's rule (min count, top next ids, the longest
    context first) over the job's texts, no context crossing a part or a -1."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(-1, 4, size=int(rng.integers(0, 80))).tolist() for _ in range(4)]
    local = ngram.LocalNgram(parts, orders=(2, 3, 4), min_count=2, top=2)
    stream = [t for p in parts for t in p + [-1]]
    plain = {k: brute(stream, [0] * len(stream), k, 2, 2, 1) for k in (2, 3, 4)}
    checked = 0
    for _ in range(300):
        run = tuple(rng.integers(0, 4, size=int(rng.integers(1, 6))).tolist())
        want = next((plain[k][run[-k:]] for k in (4, 3, 2) if k <= len(run) and run[-k:] in plain[k]), None)
        got = local.next_probs(run)
        if want is None:
            assert got is None, run
            continue
        checked += 1
        assert got[0].tolist() == [t for t, _ in want], run
        assert np.allclose(got[1], [p for _, p in want])
    assert checked > 20
    assert ngram.LocalNgram([]).next_probs((1, 2, 3)) is None and len(ngram.LocalNgram([[], None])) == 0


@pytest.mark.parametrize(
    "extra",
    [
        dict(cache=False, window=0),
        dict(cache=True, refresh_every=1, window=3, copy_bigram=1.0, copy_order=2),
        dict(cache=True, refresh_every=1, window=16, heal=True, ngram=4.0),
    ],
)
def test_service_fills_with_the_local_ngram_equal_the_oracle_and_it_changes_fills(served, extra):
    base = DecodeOptions(
        threshold=0.5, heal=False, local_ngram=0.0, **{"ngram": 0.0, **{k: v for k, v in extra.items() if k != "heal"}}
    )
    base = dataclasses.replace(base, heal=extra.get("heal", False))
    lookup = "def add(a, b):\n    return a + b\n" * 3 + "import os\nimport sys\nimport os.path\n" * 2
    changed = 0
    for prefix, suffix in CASES:
        on = dataclasses.replace(base, local_ngram=8.0)
        for look in (lookup, ""):
            got = served.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=on, lookup=look))
            p_ids, s_ids = served.tok.encode_batch([prefix, suffix])
            heal = served.tok.heal(p_ids) if on.heal else None
            if heal:
                p_ids = p_ids[: -heal.k]
            want = reference.reference_fill(
                served.model,
                p_ids,
                s_ids,
                8 + (1 if heal else 0),
                on,
                ngram=served.ngram,
                heal=heal and heal.first,
                heal_then=heal and heal.then,
                lookup=served.tok.encode(look) if look else None,
            )
            assert got.token_ids == want, (prefix, look)
            off = served.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=base, lookup=look))
            changed += got.token_ids != off.token_ids
    assert changed  # the counts reached the slots


def test_the_local_ngram_is_a_per_kind_model_setting(tmp_path):
    (tmp_path / "serving.json").write_text('{"decode": {"local_ngram": 4, "local_ngram_kinds": {"block": 0}}}')
    tuned = serving_defaults(tmp_path)["decode"]
    assert tuned == {"local_ngram": 4.0, "local_ngram_kinds": {"block": 0.0}}
    assert with_model_defaults(DecodeOptions(), tuned, "line").local_ngram == 4.0
    assert with_model_defaults(DecodeOptions(), tuned, "block").local_ngram == 0.0
    assert with_model_defaults(DecodeOptions(local_ngram=2.0), tuned, "block").local_ngram == 2.0
    assert with_model_defaults(DecodeOptions(), {}).local_ngram == 0.0
    for bad in ('{"decode": {"local_ngram": -1}}', '{"decode": {"local_ngram_kinds": {"line": 99}}}'):
        (tmp_path / "serving.json").write_text(bad)
        assert serving_defaults(tmp_path) == {}
    with pytest.raises(ValueError, match="local_ngram"):
        check_options(DecodeOptions(local_ngram=-1.0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_workspace_ngram_is_the_rule_over_the_other_files_counted_plainly(seed):
    """WorkspaceNgram.view(exclude).next_probs is LocalNgram's rule over every file but the excluded
    one; put() replaces a file, remove() drops it, a memory over its token cap refuses a file."""
    rng = np.random.default_rng(seed)
    files = {f"p/f{i}.py": rng.integers(0, 4, size=int(rng.integers(0, 90))).tolist() for i in range(5)}
    mem = ngram.WorkspaceNgram(orders=(2, 3, 4), min_count=2, top=2)
    assert mem.view() is None
    mem.put("p/f0.py", [3, 3, 3, 3])  # replaced below
    for k, ids in files.items():
        assert mem.put(k, ids)
    mem.put("p/gone.py", [1, 2, 1, 2, 1, 2])
    mem.refresh()
    assert mem.view("p/gone.py") is not None and not mem.stale
    mem.remove("p/gone.py")
    assert mem.stale and mem.view() is not None  # the old snapshot until refresh()
    mem.refresh()
    assert len(mem) == 5 and mem.tokens == sum(map(len, files.values())) and "p/gone.py" not in mem
    checked = 0
    for exclude in ("p/f0.py", "p/f3.py", None):
        view = mem.view(exclude)
        plain = ngram.LocalNgram(
            [ids for k, ids in files.items() if k != exclude], orders=(2, 3, 4), min_count=2, top=2
        )
        for _ in range(200):
            run = tuple(rng.integers(0, 4, size=int(rng.integers(1, 6))).tolist())
            want, got = plain.next_probs(run), view.next_probs(run)
            if want is None:
                assert got is None, (exclude, run)
                continue
            checked += 1
            assert got[0].tolist() == want[0].tolist(), (exclude, run)
            assert np.allclose(got[1], want[1])
    assert checked > 50
    small = ngram.WorkspaceNgram(max_tokens=10)
    assert small.put("a", list(range(8))) and not small.put("b", list(range(8))) and "b" not in small
    assert small.put("a", list(range(10)))  # a file replaced counts its new size only


def test_service_fills_with_the_workspace_ngram_equal_the_oracle_and_it_changes_fills(served):
    """The service's fills with a job naming a workspace memory (EngineService.workspace_files) and
    its document equal the oracle's plain counting over the other files (the workspace only where
    the fill's own n-gram has no context), and change fills; the job and its names cross the wire."""
    files = {
        "w/a.py": "def add(a, b):\n    return a + b\n" * 3,
        "w/b.py": "import os\nimport sys\nimport os.path\n" * 2,
        "w/self.py": "import json\n" * 4,
        "w/gone.py": "import gone\n" * 3,
    }
    got = served.workspace_files("w", files)
    assert got == {"files": 4, "tokens": sum(len(served.tok.encode(t)) for t in files.values()), "refused": 0}
    assert served.workspace_files("w", {"w/gone.py": None})["files"] == 3
    others = [served.tok.encode(t) for k, t in files.items() if k not in ("w/self.py", "w/gone.py")]
    changed = 0
    for local in (0.0, 8.0):
        base = DecodeOptions(threshold=0.5, heal=False, ngram=0.0, local_ngram=local, workspace_ngram=0.0)
        on = dataclasses.replace(base, workspace_ngram=8.0)
        for prefix, suffix in CASES:
            job = wire.job_from_message(
                wire.job_message(
                    FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=on, workspace="w", document="w/self.py")
                )
            )
            assert (job.workspace, job.document) == ("w", "w/self.py")
            fill = served.run_now(job)
            p_ids, s_ids = served.tok.encode_batch([prefix, suffix])
            want = reference.reference_fill(served.model, p_ids, s_ids, 8, on, workspace=others)
            assert fill.token_ids == want, (local, prefix)
            off = served.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=base))
            changed += fill.token_ids != off.token_ids
            for bare in (
                FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=on),  # no memory named: no effect
                FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=on, workspace="nowhere"),
            ):
                assert served.run_now(bare).token_ids == off.token_ids
    assert changed
    served.workspace_drop("w")
    assert "w" not in served.workspaces
    with pytest.raises(EngineError):
        served.workspace_files("", {})
    with pytest.raises(ValueError, match="workspace"):
        wire.job_from_message({"prefix": "x", "workspace": 3})


def test_the_workspace_ngram_is_a_per_kind_model_setting(tmp_path):
    (tmp_path / "serving.json").write_text('{"decode": {"workspace_ngram": 8, "workspace_ngram_kinds": {"block": 0}}}')
    tuned = serving_defaults(tmp_path)["decode"]
    assert tuned == {"workspace_ngram": 8.0, "workspace_ngram_kinds": {"block": 0.0}}
    assert with_model_defaults(DecodeOptions(), tuned, "line").workspace_ngram == 8.0
    assert with_model_defaults(DecodeOptions(), tuned, "block").workspace_ngram == 0.0
    assert with_model_defaults(DecodeOptions(), {}).workspace_ngram == 0.0
    with pytest.raises(ValueError, match="workspace_ngram"):
        check_options(DecodeOptions(workspace_ngram=-1.0))


@pytest.mark.parametrize("ids", [[5], [5, 6], [5, 6, 7], [5, 6, 7, 8]])
def test_a_workspace_of_files_shorter_than_an_order_counts_no_pair_of_it(ids):
    """A file with no context of k ids followed by an id (a workspace holding only `import os`) has no
    pair of order k: refresh() counts the orders it has and the rest empty (it raised IndexError,
    and the workspace memory was never updated)."""
    mem = ngram.WorkspaceNgram(orders=(2, 3, 4), min_count=1, top=2)
    assert mem.put("a.py", ids)
    mem.refresh()
    view = mem.view()
    assert view is not None
    plain = ngram.LocalNgram([ids], orders=(2, 3, 4), min_count=1, top=2)
    for ctx in ([5, 6], [5, 6, 7], [6, 7, 8], [9, 9]):
        assert view.next_probs(ctx) == plain.next_probs(ctx), ctx
