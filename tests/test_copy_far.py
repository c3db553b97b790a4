"""The copy boost's far side (DecodeOptions.copy_far, FillJob.lookup): the document beyond the
context window reaches the engine as text to search, never as tokens to forward."""

from __future__ import annotations

import dataclasses
import time

import pytest

from dlm_lsp.fill.context import FAR_AFTER, FAR_BEFORE, build_request, to_fill_job
from dlm_lsp.fill.documents import Document
from engine.api import DecodeOptions, FillJob
from engine.clients import wire
from engine.decode import reference
from tests.tiny import tiny_service


def _doc(text: str) -> Document:
    return Document("file:///t.py", "python", 1, text)


def test_far_text_is_the_document_outside_both_windows():
    body = "".join(f"def helper_{i}(x):\n    return x + {i}\n\n" for i in range(2000))
    text = body + "value = helper_7(1)\n" + body.replace("helper_", "after_")
    offset = len(body) + len("value = helper_")
    req = build_request(_doc(text), offset)
    suf_end = offset + len(req.suffix)
    assert text[offset:suf_end] == req.suffix
    after = text[suf_end : suf_end + FAR_AFTER]
    assert len(after) == FAR_AFTER and req.far.endswith("\n" + after)
    before = req.far[: -(len(after) + 1)]
    assert len(before) == FAR_BEFORE and text.count(before) == 1
    win_start = text.index(before) + FAR_BEFORE
    assert req.prefix == text[win_start:offset]  # module level: no kept headers, the window follows the far text
    assert "value = helper_" not in req.far and "after_0(x)" not in req.far  # the suffix window is not in it
    short = build_request(_doc("x = 1\ny = x\n"), 6)  # a short document: nothing beyond the windows
    assert short.far == ""
    assert to_fill_job(req, None).lookup == (req.far if req.hole_kind == "line" else "")
    line = build_request(_doc(text), len(body) + len("value = hel"))
    line.hole_kind = "line"
    assert to_fill_job(line, None).lookup == line.far != ""
    line.hole_kind = "block"  # multi-line and middle holes carry no far text (measured: docs/MODEL.md)
    assert to_fill_job(line, None).lookup == ""


def test_lookup_crosses_the_engine_socket():
    msg = wire.job_message(FillJob(prefix="x", lookup="def far():\n"))
    assert wire.job_from_message(msg).lookup == "def far():\n"
    assert wire.job_from_message({k: v for k, v in msg.items() if k != "lookup"}).lookup == ""
    with pytest.raises(ValueError, match="lookup"):
        wire.job_from_message({**msg, "lookup": 3})


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return tiny_service(tmp_path_factory.mktemp("far") / "m", seed=3)


def test_service_fill_with_lookup_equals_the_oracle_and_copy_far_0_ignores_it(service):
    base = DecodeOptions(threshold=0.5, copy_bigram=1.0, copy_order=2, heal=False)
    changed = 0
    cases = [
        ("def add(a, b):\n    return ", "\n", "import os\nimport sys\nclass Point:\n    def __init__(self, x, y):\n"),
        ("for i in range(10):\n    ", "", "print(i)\nprint(i)\nfunction f(x) { return x * 2; }\n" * 4),
        ("class Point:\n    def ", "", "def add(a, b):\n    return a + b\n" * 6),
    ]
    for prefix, suffix, lookup in cases:
        far = dataclasses.replace(base, copy_far=3.0)
        got = service.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=far, lookup=lookup))
        p_ids, s_ids = service.tok.encode_batch([prefix, suffix])
        want = reference.reference_fill(service.model, p_ids, s_ids, 8, far, lookup=service.tok.encode(lookup))
        assert got.token_ids == want
        off = service.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=base, lookup=lookup))
        plain = service.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=8, options=base))
        assert off.token_ids == plain.token_ids  # copy_far 0: the lookup text changes nothing
        changed += got.token_ids != plain.token_ids
    assert changed  # the far side reached the canvas


def test_copy_far_must_not_be_negative(service):
    from engine.api import EngineError

    with pytest.raises(EngineError, match="copy_far"):
        service.run_now(FillJob(prefix="x = ", options=DecodeOptions(copy_far=-1.0), lookup="x = 1"))


def test_copy_far_is_a_model_tunable_default(tmp_path):
    from engine.api import with_model_defaults
    from engine.weights.checkpoint import serving_defaults

    (tmp_path / "serving.json").write_text('{"decode": {"copy_bigram": 2.0, "copy_far": 3.0}}')
    tuned = serving_defaults(tmp_path)["decode"]
    assert tuned == {"copy_bigram": 2.0, "copy_far": 3.0}
    assert with_model_defaults(DecodeOptions(), tuned).copy_far == 3.0
    assert with_model_defaults(DecodeOptions(copy_far=0.0), tuned).copy_far == 0.0  # an explicit 0 turns it off
    assert with_model_defaults(DecodeOptions(), {}).copy_far == 0.0
    for bad in ('{"decode": {"copy_far": -1}}', '{"decode": {"copy_far": 50}}', '{"decode": {"copy_far": "3"}}'):
        (tmp_path / "serving.json").write_text(bad)
        assert serving_defaults(tmp_path) == {}


# ----------------------------------------------------------------------------- cross-file context


def test_neighbours_are_the_other_open_documents_most_recent_first():
    from dlm_lsp.fill.documents import ContentChange, DocumentStore

    store = DocumentStore()
    for name in ("a", "b", "c"):
        store.open(f"file:///w/{name}.py", "python", 1, f"# {name}\n")
    store.open("file:///w/notes.md", "markdown", 1, "# notes\n")
    assert [d.uri for d in store.neighbours("file:///w/a.py", "python")] == ["file:///w/c.py", "file:///w/b.py"]
    store.change("file:///w/b.py", 2, [ContentChange("# b2\n")])
    assert [d.uri for d in store.neighbours("file:///w/a.py", "python")] == ["file:///w/b.py", "file:///w/c.py"]
    assert [d.uri for d in store.neighbours("file:///w/a.py", "python", n=1)] == ["file:///w/b.py"]
    store.close("file:///w/b.py")
    assert [d.uri for d in store.neighbours("file:///w/a.py", "python")] == ["file:///w/c.py"]
    assert store.neighbours("file:///w/a.py", "rust") == []


def test_neighbour_text_cuts_each_to_a_share_and_puts_the_most_relevant_last():
    from dlm_lsp.fill.context import neighbour_text

    assert neighbour_text([]) == "" and neighbour_text(["", ""]) == ""
    got = neighbour_text(["first" * 10, "second" * 10], limit=20)
    assert got == ("second" * 10)[:10] + "\n" + ("first" * 10)[:10] + "\n"
    req = build_request(_doc("x = 1\n"), 4, neighbours=got)
    assert req.far.startswith(got)  # before the document's own far text, which the engine keeps when it cuts


def test_eval_siblings_are_the_files_of_the_same_folder_nearest_first():
    from dlm_lsp.measure.evaluate import sibling_files

    files = {k: "" for k in ("p:pkg/a.py", "p:pkg/b.py", "p:pkg/c.py", "p:pkg/sub/d.py", "stdlib:x.py", "stdlib:y.py")}
    sib = sibling_files(files, 2)
    assert sib["p:pkg/a.py"] == ["p:pkg/b.py", "p:pkg/c.py"] and sib["p:pkg/b.py"] == ["p:pkg/a.py", "p:pkg/c.py"]
    assert sib["p:pkg/sub/d.py"] == [] and sib["stdlib:x.py"] == ["stdlib:y.py"]
    assert sibling_files(files, 1)["p:pkg/c.py"] == ["p:pkg/b.py"]


async def test_server_sends_the_other_open_documents_as_lookup():
    from tests.lsp_helpers import FAKE_SERVER, inline, lsp_server, open_doc, scripted

    async with lsp_server(FAKE_SERVER, {"model": scripted(lookup=12), "postprocess": False}) as c:
        open_doc(c, "file:///tmp/dlm-far/b.py", "def far_helper(x):\n    return x\n")
        open_doc(c, "file:///tmp/dlm-far/notes.md", "# not python\n", lang="markdown")
        open_doc(c, "file:///tmp/dlm-far/a.py", "value = \n")
        items = await inline(c, "file:///tmp/dlm-far/a.py", 0, 8)
        assert items[0]["insertText"] == "def far_help"


# ----------------------------------------------------------------------------- draft chaining


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("window,cache,heal", [(0, False, False), (3, True, False), (0, True, True), (16, True, True)])
def test_copy_chain_fast_loop_matches_oracle_and_commits_more_per_step(shift, window, cache, heal):
    from engine.decode.forward import build_canvas
    from engine.decode.reference import reference_fill
    from engine.decode.sampler import fill
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=300,
        dim=32,
        n_layers=2,
        n_heads=2,
        ffn_dim=64,
        max_seq_len=512,
        logits_shift=shift,
        mask_token_id=2,
        pad_token_id=249,
        eos_token_id=1,
        bos_token_id=3,
    ).validate()
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    import torch

    more = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        prefix = torch.randint(4, 60, (40,), generator=g).tolist()  # a small alphabet: runs repeat
        suffix = torch.randint(4, 60, (8,), generator=g).tolist()
        lookup = prefix[5:25] * 3
        h = sorted({prefix[-1], prefix[-2], 7, 8, 9})[:4] if heal else None
        base = dict(
            threshold=0.5, cache=cache, refresh_every=1, window=window, copy_bigram=2.0, copy_order=3, copy_far=3.0
        )
        on, off = DecodeOptions(**base, copy_chain=True), DecodeOptions(**base, copy_chain=False)
        c = build_canvas(prefix, suffix, 8, model.cfg, on, heal=h)
        c.attach_far(lookup)
        got = fill(model, c)
        assert got.ids == reference_fill(model, prefix, suffix, 8, on, heal=h, lookup=lookup), f"seed {seed}"
        c0 = build_canvas(prefix, suffix, 8, model.cfg, off, heal=h)
        c0.attach_far(lookup)
        plain = fill(model, c0)
        assert plain.ids == reference_fill(model, prefix, suffix, 8, off, heal=h, lookup=lookup)
        more += got.steps < plain.steps
    assert more  # chaining commits copied runs in fewer steps


def test_copy_chain_is_a_model_tunable_default(tmp_path):
    from engine.api import with_model_defaults
    from engine.weights.checkpoint import serving_defaults

    (tmp_path / "serving.json").write_text('{"decode": {"copy_chain": true}}')
    assert serving_defaults(tmp_path)["decode"] == {"copy_chain": True}
    assert with_model_defaults(DecodeOptions(), {"copy_chain": True}).copy_chain is True
    assert with_model_defaults(DecodeOptions(), {}).copy_chain is False
    (tmp_path / "serving.json").write_text('{"decode": {"copy_chain": 1}}')
    assert serving_defaults(tmp_path) == {}


async def test_server_sends_snippets_of_the_workspace_files_as_lookup(tmp_path):
    """A closed file of the workspace folder reaches the engine as the snippet most like the code at
    the cursor (dlm_lsp/fill/workspace.py, indexed in a background thread); off, it does not."""
    import asyncio

    from tests.lsp_helpers import FAKE_SERVER, inline, lsp_server, open_doc, scripted

    (tmp_path / "helpers.py").write_text("def compute_total(items_list):\n    return sum(items_list)\n")
    (tmp_path / "other.py").write_text("def unrelated_thing():\n    pass\n")
    a = (tmp_path / "a.py").as_uri()
    text = "import helpers\nresult = helpers.compute_total(items_list)\nvalue = \n"
    for on in (True, False):
        opts = {"model": scripted(lookup=17), "postprocess": False, "workspaceContext": on}
        async with lsp_server(FAKE_SERVER, opts, root=str(tmp_path)) as c:
            open_doc(c, a, text)
            got = None
            end = time.monotonic() + 120
            while time.monotonic() < end:  # the walk runs beside the server: wait for its first pass
                items = await inline(c, a, 2, 8)
                got = items[0]["insertText"] if items else ""
                if got or not on:
                    break
                await asyncio.sleep(0.05)
            assert (got == "def compute_total") == on, got


class _Typist:
    """Asks for a fill at (line, col) of `uri` until it is `want` (or 120 s): each try first
    edits line 0 (an edit above the cursor, so that no kept fill serves the request)."""

    def __init__(self, uri: str, edit_col: int, line: int, col: int):
        self.uri, self.edit_col, self.line, self.col, self.version = uri, edit_col, line, col, 1

    async def fill_until(self, c, want):
        import asyncio

        from tests.lsp_helpers import inline, insert

        got = None
        end = time.monotonic() + 120  # a wait for the condition, bounded generously
        while time.monotonic() < end:
            self.version += 1
            insert(c, self.uri, self.version, 0, self.edit_col, " ")
            items = await inline(c, self.uri, self.line, self.col)
            got = items[0]["insertText"] if items else ""
            if got == want:
                return got
            await asyncio.sleep(0.05)
        return got


def _folders(added=(), removed=()):
    """workspace/didChangeWorkspaceFolders params for these folder paths."""
    return {
        "event": {
            "added": [{"uri": p.as_uri(), "name": p.name} for p in added],
            "removed": [{"uri": p.as_uri(), "name": p.name} for p in removed],
        }
    }


async def test_server_follows_workspace_folder_changes(tmp_path):
    """workspace/didChangeWorkspaceFolders: an added folder's files become snippets (walked at once,
    not at the next 60 s rescan), a removed folder's files stop being snippets."""
    from tests.lsp_helpers import FAKE_SERVER, lsp_server, open_doc, scripted

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "old.py").write_text("def compute_legacy(items_list):\n    return items_list\n")
    (two / "helpers.py").write_text("def compute_total(items_list):\n    return sum(items_list)\n")
    a = (one / "a.py").as_uri()
    text = "import helpers\nresult = helpers.compute_total(items_list)\nvalue = \n"
    fill_until, folders = _Typist(a, 14, 2, 8).fill_until, _folders

    opts = {"model": scripted(lookup=18), "postprocess": False}
    async with lsp_server(FAKE_SERVER, opts, root=str(one)) as c:
        caps = c.init_result["capabilities"]["workspace"]["workspaceFolders"]
        assert caps["supported"] and caps["changeNotifications"]
        open_doc(c, a, text)
        assert await fill_until(c, "def compute_legacy") == "def compute_legacy"
        c.notify("workspace/didChangeWorkspaceFolders", folders(added=[two], removed=[one]))
        assert await fill_until(c, "def compute_total(") == "def compute_total("
        # the option turned off and on again (workspace/didChangeConfiguration): the index stops, restarts
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"workspaceContext": False}}})
        assert await fill_until(c, "") == ""
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"workspaceContext": True}}})
        assert await fill_until(c, "def compute_total(") == "def compute_total("
        c.notify("workspace/didChangeWorkspaceFolders", folders(removed=[two]))
        # no folder left: the other open documents' starts (none here), not the removed files
        got = await fill_until(c, "")
        assert got == "", got


async def test_the_server_feeds_the_engines_workspace_memory_and_names_it_in_jobs(tmp_path):
    """The workspace's files go to the engine's workspace memory (workspace_files) as the index
    walks them; each job names that memory and its own document (left out by the engine); an added
    folder's files come in, a removed folder's leave; the option off, jobs name no memory."""
    from tests.lsp_helpers import FAKE_SERVER, lsp_server, open_doc, scripted

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "a.py").write_text("x = 1\n")
    (one / "b.py").write_text("y = 2\n")
    (two / "c.py").write_text("z = 3\n")
    a = (one / "a.py").as_uri()
    fill_until, folders = _Typist(a, 0, 1, 0).fill_until, _folders

    async with lsp_server(FAKE_SERVER, {"model": scripted(workspace=1), "postprocess": False}, root=str(one)) as c:
        open_doc(c, a, "x = 1\n\n")
        assert await fill_until(c, "b.py") == "b.py"  # a.py is the filled document
        c.notify("workspace/didChangeWorkspaceFolders", folders(added=[two]))
        assert await fill_until(c, "b.py+c.py") == "b.py+c.py"
        c.notify("workspace/didChangeWorkspaceFolders", folders(removed=[one]))
        assert await fill_until(c, "c.py") == "c.py"
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"workspaceContext": False}}})
        assert await fill_until(c, "-") == "-"
