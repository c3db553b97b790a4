"""dlm/nextEdit through the real server process: the edit history from didChange, the request through
the scheduler and the engine (the scripted engine's `rewrite`), the restraint rules and bad input."""

import asyncio

import pytest

from dlm_lsp.fill import edit_gate
from dlm_lsp.fill.nextedit import apply_edits
from dlm_lsp.fill.positions import LineIndex
from dlm_lsp.measure.replay import LspError
from tests.lsp_helpers import FAKE_SERVER, lsp_server, open_doc, scripted, until

URI = "file:///tmp/dlm-next/a.py"
ENGINE = "surprise+memory"  # an engine layout, so the scripted engine's rewrite is what comes back
SRC = "def area(width, height):\n    w = width * 2\n    return width * height + w\n"
WIDTH = SRC.index("width")  # the parameter the user renames


def change(c, version: int, start: int, end: int, text: str, doc: str) -> str:
    """Sends one ranged didChange replacing doc[start:end] with `text`; returns the new text."""
    idx = LineIndex(doc)
    (l0, c0), (l1, c1) = idx.position(start), idx.position(end)
    c.notify(
        "textDocument/didChange",
        {
            "textDocument": {"uri": URI, "version": version},
            "contentChanges": [
                {"range": {"start": {"line": l0, "character": c0}, "end": {"line": l1, "character": c1}}, "text": text}
            ],
        },
    )
    return doc[:start] + text + doc[end:]


def ask(c, version: int, line: int, character: int, uri: str = URI):
    return c.request(
        "dlm/nextEdit",
        {"textDocument": {"uri": uri, "version": version}, "position": {"line": line, "character": character}},
        timeout=60,
    )


def applied(doc: str, result: dict) -> str:
    """The document after a nextEdit result's TextEdits (UTF-16 positions, applied together)."""
    idx = LineIndex(doc)
    edits = [
        (
            idx.offset(e["range"]["start"]["line"], e["range"]["start"]["character"]),
            idx.offset(e["range"]["end"]["line"], e["range"]["end"]["character"]),
            e["newText"],
        )
        for e in result["edits"]
    ]
    return apply_edits(doc, sorted(edits))


async def renamed(c) -> str:
    """Opens SRC and renames the parameter `width` to `size` where it is declared (version 2)."""
    open_doc(c, URI, SRC)
    return change(c, 2, WIDTH, WIDTH + len("width"), "size", SRC)


async def test_the_request_is_advertised_under_experimental():
    async with lsp_server(FAKE_SERVER, {"model": scripted()}) as c:
        assert c.init_result["capabilities"]["experimental"] == {"dlm": {"nextEdit": True}}


async def test_a_rename_is_followed_at_its_other_uses():
    async with lsp_server(FAKE_SERVER, {"model": scripted(rewrite="width>size"), "nextEditApproach": ENGINE}) as c:
        doc = await renamed(c)
        res = await ask(c, 2, 0, WIDTH + len("size"))
        assert applied(doc, res) == SRC.replace("width", "size")
        assert len(res["edits"]) == 2 and 0 < res["confidence"] <= 1  # the two uses, each its own edit
        s = (await c.request("dlm/stats", {}, timeout=10))["nextEdit"]
        assert s["requests"] == 1 and s["answered"] == 1 and s["engineJobs"] == 1
        assert (await c.request("dlm/stats", {}, timeout=10))["requests"] == 0  # fills' counters untouched


async def test_the_propagation_baseline_needs_no_engine():
    """nextEditMinConfidence 0 shows what the rules make, at the edit gate's confidence; unset, the
    shipped edit gate's least confidence for the kind (a parameter renamed: "definition") decides."""
    opts = {"model": scripted(rewrite="nothing>changes"), "nextEditApproach": "propagate"}
    async with lsp_server(FAKE_SERVER, {**opts, "nextEditMinConfidence": 0}) as c:
        doc = await renamed(c)
        res = await ask(c, 2, 0, WIDTH + len("size"))
        assert applied(doc, res) == SRC.replace("width", "size") and 0.0 < res["confidence"] < 1.0
        s = (await c.request("dlm/stats", {}, timeout=10))["nextEdit"]
        assert s["answered"] == 1 and s["engineJobs"] == 0
    gate = edit_gate.shipped()
    assert gate is not None
    async with lsp_server(FAKE_SERVER, opts) as c:
        await renamed(c)
        default = await ask(c, 2, 0, WIDTH + len("size"))
        assert (default is None) == (res["confidence"] < gate.gates["definition"])
        assert default is None or default == res


@pytest.mark.parametrize(
    "rewrite,why",
    [
        ("size>width", "it takes back the user's rename"),
        ("w>w ", "whitespace only"),  # "w = width" -> "w  = width"
        ("", "the window comes back unchanged"),
    ],
)
async def test_silence_when_the_rewrite_is_not_worth_showing(rewrite, why):
    async with lsp_server(FAKE_SERVER, {"model": scripted(rewrite=rewrite), "nextEditApproach": ENGINE}) as c:
        await renamed(c)
        assert await ask(c, 2, 0, WIDTH + len("size")) is None, why
        s = (await c.request("dlm/stats", {}, timeout=10))["nextEdit"]
        assert s["engineJobs"] == 1 and s["answered"] == 0 and s["empty"] == 1


async def test_the_confidence_gate_keeps_an_unsure_rewrite_back():
    model = scripted(rewrite="width>size", confidence=0.3)
    async with lsp_server(FAKE_SERVER, {"model": model, "nextEditMinConfidence": 0.5, "nextEditApproach": ENGINE}) as c:
        await renamed(c)
        assert await ask(c, 2, 0, WIDTH + len("size")) is None
    async with lsp_server(FAKE_SERVER, {"model": model, "nextEditMinConfidence": 0.2, "nextEditApproach": ENGINE}) as c:
        await renamed(c)
        assert await ask(c, 2, 0, WIDTH + len("size")) is not None


async def test_nothing_without_an_edit_an_open_document_or_the_current_version():
    async with lsp_server(FAKE_SERVER, {"model": scripted(rewrite="width>size"), "nextEditApproach": ENGINE}) as c:
        open_doc(c, URI, SRC)
        assert await ask(c, 1, 0, 0) is None  # no edit yet: nothing to follow
        change(c, 2, WIDTH, WIDTH + len("width"), "size", SRC)
        assert await ask(c, 1, 0, 0) is None  # an older version
        assert await ask(c, 3, 0, 0) is None  # a version the server never had
        assert await ask(c, 2, 0, 0, uri="file:///tmp/dlm-next/never-opened.py") is None
        assert await ask(c, 2, 99, 0) is None  # past the end
        assert await ask(c, 2, 0, 0) is not None  # and the server is fine
        c.notify("textDocument/didClose", {"textDocument": {"uri": URI}})
        assert await ask(c, 2, 0, 0) is None  # closed: its history went with it


async def test_malformed_params_get_an_error_and_the_server_lives():
    async with lsp_server(FAKE_SERVER, {"model": scripted(rewrite="width>size"), "nextEditApproach": ENGINE}) as c:
        await renamed(c)
        for params in (
            {},
            {"textDocument": 5},
            {"textDocument": {"uri": URI}, "position": {"line": -1, "character": 0}},
        ):
            with pytest.raises(LspError) as err:
                await c.request("dlm/nextEdit", params, timeout=10)
            assert err.value.code == -32602
        assert await ask(c, 2, 0, WIDTH) is not None


async def test_a_keystroke_cancels_the_next_edit_in_flight(tmp_path):
    hold = tmp_path / "hold"
    hold.mkdir()
    async with lsp_server(
        FAKE_SERVER, {"model": scripted(rewrite="width>size", hold=str(hold)), "nextEditApproach": ENGINE}
    ) as c:
        doc = await renamed(c)
        _, fut = c.send_request(
            "dlm/nextEdit",
            {"textDocument": {"uri": URI, "version": 2}, "position": {"line": 0, "character": WIDTH + 4}},
        )
        await until(lambda: (hold / "started-1").exists(), what="the next edit's job to start")
        change(c, 3, WIDTH + 4, WIDTH + 4, "s", doc)  # the user types on: the job is stale
        assert await asyncio.wait_for(fut, 60) is None  # answered while the job was held: cancelled
        s = (await c.request("dlm/stats", {}, timeout=10))["nextEdit"]
        assert s["cancelled"] == 1 and s["answered"] == 0


async def test_a_long_history_and_a_huge_line_lose_nothing():
    async with lsp_server(FAKE_SERVER, {"model": scripted(rewrite="width>size"), "nextEditApproach": ENGINE}) as c:
        doc = await renamed(c)
        version, end = 2, len(doc) - 1  # the end of the last line
        for burst in range(20):  # 10,000 keystrokes, in bursts the server reads at once: 500 typed, 500 erased
            with c.corked():
                for _ in range(500):
                    version += 1
                    if burst % 2 == 0:
                        doc, end = change(c, version, end, end, "x", doc), end + 1
                    else:
                        doc, end = change(c, version, end - 1, end, "", doc), end - 1
        got = await c.request("dlm/documentText", {"textDocument": {"uri": URI}}, timeout=60)
        assert got["text"] == doc and got["version"] == version
        # typed and taken back, the keystrokes left no edit: the rename is still what is followed
        res = await ask(c, version, 0, WIDTH + len("size"))
        assert applied(doc, res) == SRC.replace("width", "size")
        huge = "s = '" + "y" * 2_000_000 + "'\n"
        doc = change(c, version + 1, 0, 0, huge, doc)
        assert await ask(c, version + 1, 0, 10) is None  # a 2 MB document keeps no history: nothing to follow
        got = await c.request("dlm/documentText", {"textDocument": {"uri": URI}}, timeout=60)
        assert got["text"] == doc


def test_the_region_two_texts_differ_in_is_found_exactly():
    # the history's record of a didChange that is not one ranged change (several, or the full text)
    import random

    from dlm_lsp.server import _differing

    rng = random.Random(7)
    for _ in range(2000):
        a = "".join(rng.choice("ab\n") for _ in range(rng.randrange(0, 30)))
        i, j = sorted(rng.randrange(0, len(a) + 1) for _ in range(2))
        b = a[:i] + "".join(rng.choice("ab\n") for _ in range(rng.randrange(0, 6))) + a[j:]
        start, end_a, end_b = _differing(a, b)
        assert a[:start] + b[start:end_b] + a[end_a:] == b
        assert a[:start] == b[:start] and a[end_a:] == b[end_b:] and start <= min(end_a, end_b)
        # the head is as long as it can be, then the tail as long as it can be after it
        assert start == min(len(a), len(b)) or a[start] != b[start]
        assert start in (end_a, end_b) or a[end_a - 1] != b[end_b - 1]
