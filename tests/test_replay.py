"""`dlm-lsp replay`: typing a file into the real server process and measuring it."""

import json
import os
import subprocess
import sys

import pytest

from dlm_lsp.measure.replay import _percentile, replay, write_histogram
from tests.lsp_helpers import FAKE_SERVER, REPO, TEST_BUDGET_MS, scripted
from tests.tiny import make_tiny_checkpoint

KEYS = {
    "requests",
    "answered",
    "cancelled",
    "typed_through",
    "p50_ms",
    "p95_ms",
    "max_ms",
    "wasted_step_share",
    "next_text_match",
}
ROW_KEYS = {
    "engine_jobs_run",
    "forwarded_tokens_mean",
    "forwarded_tokens_p95",
    "recompute_tokens_mean",
    "recompute_tokens_p95",
    "forwarded_ratio",
    "reuse_share",
}


async def test_replay_counts_typing_through_and_matches(tmp_path):
    # the scripted engine always proposes "ello_world = 1": right after the "h" it is exactly what is
    # typed next, so the following keystrokes are served from the shown fill without the engine; in
    # lockstep the first keystroke's job runs (no second keystroke supersedes it), on any machine
    src = tmp_path / "hello.py"
    src.write_text("hello_world = 1\n")
    res = await replay(
        str(src),
        cps=10,
        max_chars=100,
        model=scripted(steps=2, step_ms=5, text="ello_world = 1"),
        server_cmd=FAKE_SERVER,
        budget_ms=TEST_BUDGET_MS,  # not 300 ms: a busy machine's first fill came back empty (CI, session 32)
        lockstep=True,
    )
    assert KEYS <= set(res)
    assert res["requests"] == 16
    assert res["typed_through"] == 13  # "e" .. "=" + " " : every proper prefix of the fill
    assert res["engine_jobs"] <= 3
    assert res["answered"] >= 14
    assert res["next_text_match"] >= 0.8
    assert res["p50_ms"] is not None and res["p50_ms"] <= res["p95_ms"] <= res["max_ms"]
    assert res["wasted_step_share"] == 0.0  # nothing was superseded at this pace
    # this engine reports no forwarded rows: replay says so instead of making numbers up
    assert ROW_KEYS <= set(res) and res["forwarded_tokens_mean"] is None and res["reuse_share"] is None


async def test_replay_at_types_a_span_back_into_the_existing_file(tmp_path):
    # the document opens as the file less "bb = 2\n", which is typed back at offset 9; the scripted
    # engine echoes the job's last 12 prefix characters (line breaks as U+23CE), so a shown fill
    # starts with what the server had 12 characters before the cursor: the file's head, at the
    # cursor's line and column
    src = tmp_path / "x.py"
    src.write_text("zq = 111\nbb = 2\ncc = 3\n")
    res = await replay(
        str(src),
        cps=5,
        max_chars=7,
        at=9,
        model=scripted(steps=1, step_ms=1, echo=12),
        server_cmd=FAKE_SERVER,
        budget_ms=TEST_BUDGET_MS,
        lockstep=True,  # every fill is shown: answered before the next keystroke
    )
    assert res["at"] == 9 and res["chars"] == 7 and res["requests"] == 7
    fills = {f["i"]: f["fill"] for f in res["shown_fills"]}
    assert fills[1].startswith("zq ="), fills  # "zq = 111\nb": the head was there
    assert fills[6].startswith("= 111"), fills  # "= 111\nbb = 2": and the cursor followed the typing
    with pytest.raises(ValueError):
        await replay(str(src), at=999, server_cmd=FAKE_SERVER)


async def test_replay_fast_typing_wastes_and_cancels(tmp_path):
    # jobs of 8 x 20 ms against keystrokes every 25 ms; every other keystroke is a line break, which
    # no running job survives. Each job then holds (the scripted engine's hold folder, never released)
    # until a newer keystroke cancels it, the last one until its deadline: no request is answered
    # before the next keystroke supersedes it, however slow the machine (issue 44: a busy one read the
    # keystrokes in bursts and dropped each superseded request before it started, so no job stepped).
    src = tmp_path / "x.py"
    src.write_text("a\n" * 10)
    hold = tmp_path / "hold"
    hold.mkdir()
    res = await replay(
        str(src),
        cps=40,
        max_chars=20,
        model=scripted(steps=8, step_ms=20, text="zz", hold=str(hold)),
        server_cmd=FAKE_SERVER,
        budget_ms=3000,
    )
    assert res["requests"] == 20
    assert res["cancelled"] >= 15  # superseded: cancelled in a job, or dropped as stale before one
    assert res["answered"] <= 2
    # every job that stepped was cancelled and wasted, but the last one (ended by its deadline): the
    # waste is all the steps but the last job's (a slow machine may drop every request before the last)
    steps, wasted = res["engine_steps"], res["wasted_steps"]
    assert 0 <= steps - wasted <= 8 and (wasted > 0 or steps <= 8), res
    assert res["wasted_step_share"] == round(wasted / steps, 4), res


async def test_replay_typing_along_a_slow_fill(tmp_path):
    # a 160 ms job proposes exactly what is typed next: typing along it, the later keystrokes
    # are served from it instead of each starting (and cancelling) a job
    src = tmp_path / "x.py"
    # 20 keystrokes at 20/s, each 50 ms, less than a job: keystrokes land while it runs. The fill is
    # what follows the job's prefix in the file, so it is right whichever keystroke's job runs (a slow
    # machine may answer the first keystrokes only after later ones arrived)
    src.write_text("abcdefghijklmnopqrstuvwxyz\n")
    res = await replay(
        str(src),
        cps=20,
        max_chars=20,
        model=scripted(steps=8, step_ms=20, follow="abcdefghijklmnopqrstuvwxyz"),
        server_cmd=FAKE_SERVER,
        budget_ms=5000,
    )
    assert res["typed_along"] >= 1 and res["typed_through"] >= 1
    assert res["engine_jobs"] <= 3 and res["wasted_step_share"] == 0.0


async def test_replay_with_client_cancel(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("abcdefghij\n")
    res = await replay(
        str(src),
        cps=40,
        max_chars=10,
        cancel=True,
        model=scripted(steps=8, step_ms=20, text="zz"),
        server_cmd=FAKE_SERVER,
        budget_ms=5000,
    )
    assert res["requests"] == 10 and res["cancelled"] >= 7
    assert res["errors"] == 0  # RequestCancelled answers are cancellations, not errors


def test_histogram_png(tmp_path):
    out = tmp_path / "h.png"
    write_histogram([10.0, 20.0, 25.0, 300.0], str(out), "t", budget_ms=300)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_command_with_the_default_model(tmp_path):
    """`dlm-lsp replay` end to end: real server, real model, JSON and PNG written."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [
        sys.executable,
        "-m",
        "dlm_lsp",
        "replay",
        "examples/tide_log.py",
        "--max-chars",
        "30",
        "--cps",
        "20",
        "--json",
        str(out),
        "--png",
        str(png),
    ]
    if os.environ.get("DLM_LSP_TEST_MODEL"):
        cmd += ["--model", os.environ["DLM_LSP_TEST_MODEL"]]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert KEYS <= set(res)
    assert res["requests"] == 30
    assert res["answered"] + res["cancelled"] + res["empty"] >= 30 - res["typed_through"]
    assert png.read_bytes()[:4] == b"\x89PNG"


async def test_replay_reports_tokens_forwarded_per_keystroke(tmp_path):
    # the scripted engine's first job of the document forwards 200 rows, every later one 30 and reuses
    # 170 (dlm_lsp/measure/fuzz/scripted_engine.py); "zz" is never typed, so in lockstep every
    # keystroke's job runs
    src = tmp_path / "x.py"
    src.write_text("abcdefghijkl\n")
    for reused in (170, 0):
        res = await replay(
            str(src),
            cps=20,
            max_chars=12,
            server_cmd=FAKE_SERVER,
            budget_ms=60_000,
            model=scripted(steps=2, step_ms=5, text="zz", forwarded=200 - reused, reused=reused),
            lockstep=True,
        )
        assert ROW_KEYS <= set(res)
        jobs = res["engine_jobs_run"]
        assert jobs == res["engine_jobs"] == 12
        forwarded = [200] + [200 - reused] * (jobs - 1)
        assert res["recompute_tokens_mean"] == res["recompute_tokens_p95"] == 200
        assert res["forwarded_tokens_mean"] == round(sum(forwarded) / jobs, 1)
        assert res["forwarded_tokens_p95"] == _percentile(forwarded, 0.95)
        assert res["forwarded_ratio"] == round(sum(forwarded) / (200 * jobs), 4)
        assert res["reuse_share"] == (round((jobs - 1) / jobs, 4) if reused else 0.0)


async def test_replay_on_a_reorder_model_forwards_less_than_a_full_recompute(tmp_path):
    """The real server and engine on a tiny recipe (c) checkpoint: keystrokes reuse the document's
    context, and dlm/stats carries what that saved to replay."""
    model = make_tiny_checkpoint(tmp_path / "m", attention="causal", canvas="reorder")
    src = tmp_path / "x.py"
    src.write_text("import os\nimport sys\n\nx = os.path\n")
    res = await replay(str(src), cps=10, max_chars=24, model=str(model), budget_ms=60_000, lockstep=True)
    assert res["engine_jobs_run"] >= 5 and res["errors"] == 0
    # a short document: the context is small beside the slots each step runs, so the saving is too
    assert res["reuse_share"] >= 0.3 and res["forwarded_ratio"] < 1.0
    assert res["forwarded_tokens_mean"] < res["recompute_tokens_mean"]
    assert res["forwarded_tokens_p95"] <= res["recompute_tokens_p95"]
