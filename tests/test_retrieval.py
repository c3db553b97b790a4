"""Cross-file snippets (dlm_lsp/fill/retrieval.py) and the workspace index (dlm_lsp/fill/workspace.py)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from dlm_lsp.fill.documents import Document, uri_key
from dlm_lsp.fill.retrieval import (
    CHUNK_LINES,
    MAX_CHUNK_CHARS,
    SnippetIndex,
    cross_file_text,
    identifiers,
    query_text,
    snippet_text,
    windows,
)
from dlm_lsp.fill.workspace import WorkspaceIndex, nearness, root_paths


def _module(name: str, body_names: list[str], lines: int = 60) -> str:
    rows = [
        f"def {name}_{i}({body_names[i % len(body_names)]}):"
        if i % 6 == 0
        else f"    {body_names[i % len(body_names)]} = {body_names[(i + 1) % len(body_names)]} + {i}"
        for i in range(lines)
    ]
    return "\n".join(rows) + "\n"


def _brute(index: SnippetIndex, query: str, exclude=None) -> list[tuple[float, str, int]]:
    """Jaccard of every live chunk against the query, common identifiers left out: the reference."""
    chunks = [index.chunk(i) for i in range(len(index._source))]
    common = max(20, int(0.3 * sum(c is not None for c in chunks)))
    df = {w: len(p) for w, p in index._postings.items()}
    q = {w for w in identifiers(query) if df.get(w, 0) <= common}
    out = []
    for c in chunks:
        if c is None or c.source == exclude:
            continue
        cs = {w for w in identifiers(c.text) if df[w] <= common}
        if q & cs:
            out.append((len(q & cs) / len(q | cs), c.source, c.line))
    return out


def test_identifiers_and_windows():
    assert identifiers("def f(self, value_x): return None if x else value_x.y") == {"value_x"}
    text = "\n".join(f"name_{i} = {i}" for i in range(50))
    ws = windows(text)
    assert [line for line, _ in ws] == list(range(0, 50 - CHUNK_LINES + 12, 12))
    assert ws[0][1].split("\n")[0] == "name_0 = 0" and len(ws[0][1].split("\n")) == CHUNK_LINES
    assert windows("") == [] and windows("\n\n  \n") == []
    rows = ["x" * 300 + f" name_{i}" for i in range(30)] + [""]  # a window of long lines is cut
    text = "\n".join(rows)
    assert [(line, t) for line, t in windows(text)] == [
        (s, "\n".join(rows[s : s + CHUNK_LINES])[:MAX_CHUNK_CHARS]) for s in range(0, 31 - CHUNK_LINES + 12, 12)
    ]
    text = "a\nb\nc\nd\ne\nf"
    assert query_text(text, 5, lines=1, after=1) == "\nb\nc\nd\ne"  # 1 line above, the cursor's line, below
    assert query_text(text, 4, lines=0, after=0) == "\nc" and query_text(text, 0, lines=3, after=0) == "a"
    assert query_text("abc", 2) == "abc" and query_text(text, len(text)) == text


def test_search_ranks_by_jaccard_excludes_the_document_and_keeps_the_budget():
    index = SnippetIndex()
    rng = random.Random(0)
    vocab = [f"name{i}" for i in range(200)]
    for k in range(12):
        index.add(f"file:///w/m{k}.py", _module(f"m{k}", rng.sample(vocab, 8), lines=rng.randint(10, 90)))
    index.add("file:///w/target.py", _module("target", ["alpha_key", "beta_value", "gamma_total"]))
    query = "alpha_key = beta_value + gamma_total\n" + "x = name3\n"
    got = index.search(query, 10_000)
    assert got and got[0].source == "file:///w/target.py"
    ref = sorted(_brute(index, query), key=lambda t: -t[0])
    assert (got[0].source, got[0].line) in [(s, l) for score, s, l in ref if score == ref[0][0]]
    scores = {(s, l): score for score, s, l in ref}
    picked = [scores[(c.source, c.line)] for c in got]
    assert picked == sorted(picked, reverse=True)  # most similar first
    assert sum(len(c.text) + 1 for c in got) <= 10_000
    for a in got:  # no two overlapping windows of one source
        assert not any(b is not a and b.source == a.source and abs(b.line - a.line) < CHUNK_LINES for b in got)
    assert all(c.source != "file:///w/target.py" for c in index.search(query, 10_000, exclude="file:///w/target.py"))
    assert index.search(query, 0) == [] and index.search("if else", 10_000) == []
    text = snippet_text(got)
    assert text.endswith(got[0].text + "\n")  # the most similar last: the far text keeps its end
    assert cross_file_text(index, query, len(query), 10_000) == text


def test_common_identifiers_carry_no_signal():
    index = SnippetIndex()
    for k in range(30):  # `shared_everywhere` is in every chunk
        index.add(f"s{k}", f"shared_everywhere = unique_{k}\n")
    got = index.search("shared_everywhere", 10_000)
    assert got == []
    assert [c.source for c in index.search("shared_everywhere + unique_7", 10_000)] == ["s7"]


def test_replace_remove_and_compact_keep_the_index_true():
    index = SnippetIndex()
    index.add("a", "apple_tree = 1\n")
    index.add("b", "banana_split = 2\n")
    assert [c.source for c in index.search("apple_tree", 1000)] == ["a"]
    index.add("a", "cherry_pie = 3\n")  # replaced: the old text is gone
    assert index.search("apple_tree", 1000) == [] and [c.source for c in index.search("cherry_pie", 1000)] == ["a"]
    index.remove("b")
    assert index.search("banana_split", 1000) == [] and len(index) == 1
    for k in range(1100):
        index.add(f"f{k}", f"filler_{k} = banana_split\n")
    for k in range(1000):
        index.remove(f"f{k}")  # most chunks dead: compacted
    assert len(index) == 101 and len(index._source) < 1103  # compacted (once it was over half dead)
    assert {c.source for c in index.search("banana_split filler_1050", 100_000)} >= {"f1050"}
    assert [c.source for c in index.search("cherry_pie", 1000)] == ["a"]


def _tree(root, files: dict[str, str | bytes]):
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())


def test_workspace_walks_only_what_it_should(tmp_path):
    _tree(
        tmp_path,
        {
            "pkg/util.py": "def checksum_value(data_block):\n    return data_block\n",
            "pkg/big.py": "x_big = 1\n" * 30_000,  # over MAX_FILE_BYTES
            "pkg/bin.py": b"\x00\x01binary_thing = 1\n",
            "pkg/latin.py": "caf\xe9_name = 1\n".encode("latin-1"),
            ".git/hooks.py": "hidden_name = 1\n",
            "node_modules/lib.py": "dep_name = 1\n",
            ".venv/lib/x.py": "venv_name = 1\n",
            "notes.md": "markdown_name\n",
            "web/app.ts": "const typed_name = 1;\n",
        },
    )
    os.symlink(tmp_path / "pkg/util.py", tmp_path / "pkg/link.py")
    ws = WorkspaceIndex([tmp_path], serves=lambda lang: lang == "python", yield_s=0)
    assert ws.scan() == 1 and ws.disk_files("python") == 1 and ws.disk_files("typescript") == 0
    assert ws._indexes["python"].sources() == [uri_key((tmp_path / "pkg/util.py").as_uri())]
    assert ws.scan() == 0  # nothing changed: nothing read again
    limited = WorkspaceIndex([tmp_path], max_files=1, yield_s=0)
    assert len(limited.files()) == 1


def test_workspace_snippets_follow_disk_and_editor(tmp_path):
    _tree(tmp_path, {"a.py": "value = 1\n", "helpers.py": "def checksum_value(data_block):\n    return data_block\n"})
    ws = WorkspaceIndex([tmp_path], yield_s=0)
    me = (tmp_path / "a.py").as_uri()
    assert ws.cross_file(me, "", 0, "python", [], 24000) is None  # nothing indexed yet: the caller's fallback
    assert WorkspaceIndex([os.path.relpath(tmp_path)]).roots == [tmp_path]  # relative roots are made absolute
    ws.scan()
    text = "x = checksum_value(data_block)\n"
    assert "def checksum_value" in ws.cross_file(me, text, len(text), "python", [], 24000)
    helpers = tmp_path / "helpers.py"
    helpers.write_text("def other_thing(data_block):\n    pass\n")
    os.utime(helpers, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert ws.scan() == 1
    got = ws.cross_file(me, text, len(text), "python", [], 24000)
    assert "checksum_value" not in got and "other_thing" in got
    # an open document is read from the editor's text, not the disk's
    doc = Document(helpers.as_uri(), "python", 3, "def checksum_value(data_block):\n    return 42\n")
    assert "return 42" in ws.cross_file(me, text, len(text), "python", [doc], 24000)
    ws.scan()  # the walk leaves an open document alone
    assert "return 42" in ws.cross_file(me, text, len(text), "python", [doc], 24000)
    ws.closed(doc.uri)  # closed: the disk's text again after the next walk
    ws.scan()
    assert "other_thing" in ws.cross_file(me, text, len(text), "python", [], 24000)
    helpers.unlink()
    ws.scan()
    assert ws.cross_file(me, text, len(text), "python", [], 24000) == ""
    # the document being filled is never its own snippet
    assert "value = 1" not in ws.cross_file(me, "value\n", 6, "python", [], 24000)


def test_workspace_follows_folder_changes(tmp_path):
    """set_roots (workspace/didChangeWorkspaceFolders) walks the new folders at once, without waiting
    for the rescan period: an added folder's files come in, a removed one's leave."""
    one, two = tmp_path / "one", tmp_path / "two"
    _tree(one, {"old.py": "def legacy_total(row_items):\n    return row_items\n"})
    _tree(two, {"new.py": "def legacy_total(fresh_items):\n    return fresh_items\n"})
    ws = WorkspaceIndex([one], yield_s=0, rescan_s=3600)
    me = (tmp_path / "a.py").as_uri()
    text = "y = legacy_total(row_items, fresh_items)\n"

    def wait_for(pred):
        for _ in range(400):
            got = ws.cross_file(me, text, len(text), "python", [], 24000)
            if got is not None and pred(got):
                return got
            time.sleep(0.01)
        raise AssertionError(ws.cross_file(me, text, len(text), "python", [], 24000))

    ws.start()
    try:
        wait_for(lambda got: "row_items" in got and "fresh_items" not in got)
        scans = ws.scans
        ws.set_roots([one])  # the same folders: no walk
        time.sleep(0.05)
        assert ws.scans == scans
        ws.set_roots([one, two])
        wait_for(lambda got: "row_items" in got and "fresh_items" in got)
        ws.set_roots([two])
        wait_for(lambda got: "row_items" not in got and "fresh_items" in got)
        ws.set_roots([])  # no folder: nothing from disk, the caller falls back to the open documents
        for _ in range(400):
            if ws.cross_file(me, text, len(text), "python", [], 24000) is None:
                break
            time.sleep(0.01)
        assert ws.cross_file(me, text, len(text), "python", [], 24000) is None and ws.disk_files("python") == 0
    finally:
        ws.close()
    assert ws.roots == []


def test_root_paths(tmp_path):
    class Folder:
        def __init__(self, uri):
            self.uri = uri

    assert root_paths(tmp_path.as_uri(), None) == [tmp_path]
    assert root_paths(None, [Folder(tmp_path.as_uri()), Folder(tmp_path.as_uri()), Folder("https://x/y")]) == [tmp_path]
    assert root_paths("file:///no/such/dir", None) == [] and root_paths(None, None) == [] and root_paths(3, None) == []


def test_eval_retrieval_scopes():
    from dlm_lsp.measure.evaluate import package_files, retrieval_fn
    from dlm_lsp.measure.holes import Hole

    files = {
        "p:pkg/a.py": "def use():\n    return shared_helper_name(1)\n",
        "p:pkg/b.py": "def shared_helper_name(x):\n    return x\n",
        "q:q/c.py": "def shared_helper_name(y):\n    return y\n",
    }
    assert package_files(files)["p:pkg/a.py"] == ["p:pkg/b.py"] and package_files(files)["q:q/c.py"] == []
    fn = retrieval_fn(files, "package")
    text = files["p:pkg/a.py"]
    got = fn(Hole("line", "p:pkg/a.py", text, len(text) - 4, len(text) - 4))
    assert "return x" in got and "return y" not in got and "use()" not in got
    assert fn(Hole("line", "q:q/c.py", files["q:q/c.py"], 5, 5)) == ""
    with pytest.raises(ValueError, match="--neighbours"):
        retrieval_fn(files, "neighbours", 0)


def test_workspace_walk_limits(tmp_path):
    _tree(tmp_path, {f"m{i:02d}.py": f"name_{i} = {i}\n" * 10 for i in range(20)})
    per_file = len("name_0 = 0\n" * 10)
    ws = WorkspaceIndex([tmp_path], yield_s=0, max_total_bytes=per_file * 5 + 20)
    assert ws.scan() == 5  # files stop being taken past the total
    ws = WorkspaceIndex([tmp_path], yield_s=0, max_entries=10)
    assert ws.files() == []  # a folder with more entries than the walk may look at


def test_nearness():
    a = Path("/r/pkg/sub")
    assert nearness(a, [a]) == (0, 0)
    assert nearness(a, [Path("/r/pkg")]) == (1, 0) and nearness(Path("/r/pkg"), [a]) == (1, 0)
    assert nearness(a, [Path("/r/pkg/other")]) == (2, 0)
    assert nearness(a, [Path("/r/elsewhere/deep/er"), Path("/r/pkg/other")]) == (2, 1)  # the nearest counts
    assert nearness(a, [Path("/r/x"), a, Path("/r/pkg/sub")]) == (0, 1)  # then the most recent
    assert nearness(a, []) == (0, 0)


def test_a_binding_limit_keeps_the_files_nearest_the_focus(tmp_path, monkeypatch):
    """A big repository (here: more files than max_files, more text than the memory holds): the
    walk takes the files nearest the folders being worked in, snippets and memory alike; a fill in
    a folder the walk did not favour wakes it, and the farthest files leave for the nearest."""
    from dlm_lsp.fill import workspace as W

    files = {f"aa/f{i}.py": f"alpha_{i} = {i}\n" for i in range(4)}
    files.update({f"mm/f{i}.py": f"middle_{i} = {i}\n" for i in range(4)})
    files.update({"zz/sub/f0.py": "zeta_0 = 0\n", "zz/sub/f1.py": "zeta_1 = 1\n", "zz/g.py": "zeta_g = 2\n"})
    _tree(tmp_path, files)
    ws = WorkspaceIndex([tmp_path], max_files=3, yield_s=0, rescan_s=3600)

    def names(got):
        return [str(p.relative_to(tmp_path)) for p, _ in got]

    assert ws.scan() == 3 and names(ws.files()) == ["aa/f0.py", "aa/f1.py", "aa/f2.py"]  # no focus yet: walk order
    here = tmp_path / "zz/sub/new.py"
    ws.focus([here.as_uri(), "untitled:Untitled-1"])  # URIs that are not files are ignored
    assert ws._wake.is_set()  # the last walk left files out: walk again for the new focus
    assert names(ws.files()) == ["zz/sub/f0.py", "zz/sub/f1.py", "zz/g.py"]  # distance 0, 0, 1
    ws._wake.clear()
    ws.focus([here.as_uri()])
    assert not ws._wake.is_set()  # the walk already ordered by that folder

    # the memory: a budget of about three files, nearest first; a new focus evicts the farthest
    monkeypatch.setattr(W, "MEMORY_CHARS", 40)  # bytes: three of these files
    ws = WorkspaceIndex([tmp_path], max_files=100, yield_s=0, rescan_s=3600)
    got = []
    ws.on_files = lambda ch: got.append(
        {str(Path(unquote(urlparse(k).path)).relative_to(tmp_path)): v for k, v in ch.items()}
    )
    me = (tmp_path / "mm/new.py").as_uri()
    text = "x = middle_1\n"
    assert ws.cross_file(me, text, len(text), "python", [], 24000) is None  # nothing indexed yet; the focus is set
    ws.scan()
    assert got == [{"mm/f0.py": "middle_0 = 0\n", "mm/f1.py": "middle_1 = 1\n", "mm/f2.py": "middle_2 = 2\n"}]
    assert ws.disk_files("python") == 11  # the snippets' limits do not bind here: every file is indexed
    assert "middle_1" in ws.cross_file(me, text, len(text), "python", [], 24000)
    ws._wake.clear()
    there = tmp_path / "zz/sub/new.py"
    doc = Document((tmp_path / "aa/f0.py").as_uri(), "python", 1, "alpha_0 = 0\n")
    ws.cross_file(there.as_uri(), "x = zeta_1\n", 10, "python", [doc], 24000)
    assert ws._wake.is_set() and ws._focus[:2] == [there.parent, tmp_path / "aa"]
    ws.scan()
    # order: zz/sub (the newest folder), aa (the open document's, whose editor text is never sent),
    # mm, then zz/g.py (a step away); 11 + 11 + 12 bytes fit, the next 12 does not
    assert got[-1] == {
        "mm/f0.py": None,
        "mm/f1.py": None,
        "mm/f2.py": None,
        "zz/sub/f0.py": "zeta_0 = 0\n",
        "zz/sub/f1.py": "zeta_1 = 1\n",
    }
    assert [v is None for v in got[-1].values()] == [True] * 3 + [False] * 2  # room is made before files come
    ws.scan()
    assert len(got) == 2  # nothing changed: nothing sent
    small = WorkspaceIndex([tmp_path / "aa"], yield_s=0, rescan_s=3600)  # no limit binds: the order does not matter
    small.scan()
    small.focus([here.as_uri()])
    assert not small._wake.is_set()


def test_headless_complete_takes_the_workspace_snippets(tmp_path):
    """`dlm-lsp complete --workspace DIR`: the job's far text holds the most similar window of the
    folder's other files, and never the file's own."""
    from dlm_lsp.headless import complete
    from engine.api import Fill

    (tmp_path / "helpers.py").write_text("def compute_total(items_list):\n    return sum(items_list)\n")
    (tmp_path / "a.py").write_text("import helpers\nresult = helpers.compute_total(items_list)\nvalue = \n")
    jobs = []

    class Engine:
        serving: dict = {}

        def run_now(self, job):
            jobs.append(job)
            return Fill(text="1", tokens=1, steps=1, slots=16)

    complete(str(tmp_path / "a.py"), 3, 9, engine=Engine(), workspace=str(tmp_path))
    complete(str(tmp_path / "a.py"), 3, 9, engine=Engine())
    assert "def compute_total" in jobs[0].lookup and "import helpers" not in jobs[0].lookup
    assert "def compute_total" not in jobs[1].lookup


def test_headless_complete_gives_the_engine_the_workspace_memory(tmp_path):
    """`dlm-lsp complete --workspace DIR` with an engine that keeps a workspace memory: the folder's
    files (the filled one too: the engine leaves it out) go there, and the job names the memory and
    its document; an engine without one gets neither."""
    from dlm_lsp.headless import complete
    from engine.api import Fill

    (tmp_path / "helpers.py").write_text("def compute_total(items_list):\n    return sum(items_list)\n")
    (tmp_path / "a.py").write_text("import helpers\nresult = helpers.compute_total(items_list)\nvalue = \n")
    jobs, sent = [], {}

    class Engine:
        serving: dict = {}

        def run_now(self, job):
            jobs.append(job)
            return Fill(text="1", tokens=1, steps=1, slots=16)

    class Keeping(Engine):
        def workspace_files(self, space, files):
            sent.setdefault(space, {}).update(files)

    complete(str(tmp_path / "a.py"), 3, 9, engine=Keeping(), workspace=str(tmp_path))
    complete(str(tmp_path / "a.py"), 3, 9, engine=Engine(), workspace=str(tmp_path))
    assert sorted(k.rsplit("/", 1)[-1] for k in sent["workspace"]) == ["a.py", "helpers.py"]
    assert (
        jobs[0].workspace == "workspace"
        and jobs[0].document.endswith("/a.py")
        and jobs[0].document in sent["workspace"]
    )
    assert jobs[1].workspace is None and jobs[1].document is None
    # a workspace past the memory's budget: the files nearest the filled one go first
    (tmp_path / "aaa").mkdir()
    (tmp_path / "aaa/first.py").write_text("x = 1\n" * 5)  # 30 bytes: first in walk order
    (tmp_path / "zzz").mkdir()
    (tmp_path / "zzz/near.py").write_text("y = 2\n" * 3)  # 18
    (tmp_path / "zzz/b.py").write_text("value = \n")
    sent.clear()
    import dlm_lsp.fill.workspace as W

    old, W.MEMORY_CHARS = W.MEMORY_CHARS, 40
    try:
        complete(str(tmp_path / "zzz/b.py"), 1, 9, engine=Keeping(), workspace=str(tmp_path))
    finally:
        W.MEMORY_CHARS = old
    assert sorted(k.rsplit("/", 1)[-1] for k in sent["workspace"]) == ["b.py", "near.py"]


def test_the_walk_sends_changed_and_removed_files_to_the_memory_once(tmp_path):
    """WorkspaceIndex.on_files: a walk sends the files it read, the next only what changed or left;
    set_sink (a new engine) sends everything again; a sink that fails is retried the next walk; the
    memory's character budget holds."""
    import os

    from dlm_lsp.fill import workspace as W

    _tree(tmp_path, {"a.py": "a = 1\n", "b.py": "b = 2\n"})
    got = []
    ws = WorkspaceIndex([tmp_path], yield_s=0)
    ws.on_files = lambda ch: got.append({k.rsplit("/", 1)[-1]: v for k, v in ch.items()})
    ws.scan()
    ws.scan()
    assert got == [{"a.py": "a = 1\n", "b.py": "b = 2\n"}]
    (tmp_path / "a.py").write_text("a = 10\n")
    os.utime(tmp_path / "a.py", ns=(1, 1))
    (tmp_path / "b.py").unlink()
    ws.scan()
    assert got[-1] == {"a.py": "a = 10\n", "b.py": None}
    ws.set_sink(ws.on_files)
    ws.scan()
    assert got[-1] == {"a.py": "a = 10\n"}

    def broken(ch):
        raise RuntimeError("engine gone")

    ws.set_sink(broken)
    ws.scan()  # logged, not raised
    ws.on_files = lambda ch: got.append({k.rsplit("/", 1)[-1]: v for k, v in ch.items()})
    ws.scan()
    assert got[-1] == {"a.py": "a = 10\n"}  # sent again
    keep = ws.on_files
    _tree(tmp_path, {"c.py": "c = 3\n"})
    ws.scan()
    assert got[-1] == {"c.py": "c = 3\n"}
    (tmp_path / "c.py").unlink()
    ws.on_files = broken
    ws.scan()  # the removal is not delivered...
    ws.on_files = keep
    ws.scan()
    assert got[-1] == {"c.py": None}  # ...so the next walk sends it again
    ws.scan()
    assert got[-1] == {"c.py": None} and len([g for g in got if "c.py" in g]) == 2  # once
    _tree(tmp_path, {"big.py": "x" * 50 + "\n"})
    old = W.MEMORY_CHARS
    try:
        W.MEMORY_CHARS = 20
        ws.set_sink(ws.on_files)
        ws.scan()
        assert got[-1] == {"a.py": "a = 10\n"}  # the big file is past the budget
    finally:
        W.MEMORY_CHARS = old
