"""The workspace walker (dlm_lsp/fill/workspace.py) reads only regular files inside the workspace,
even while another process swaps its files and folders for links, FIFOs and devices (issue 39,
item 2): a file checked with lstat and then opened by name let a swap in between make the server
read a file from outside the folder, and a swap to /dev/zero would have been an unbounded read.

A swapper process exchanges names (renameat2(RENAME_EXCHANGE) when the kernel has it, else three
renames) as fast as it can while the walks run; a swap placed exactly between the walker's stat and
its open shows the same without a race. Whatever the walker hands on is checked: the snippet index,
the engine's workspace memory (on_files) and the cross-file text a fill gets.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dlm_lsp.fill import workspace as W
from dlm_lsp.fill.workspace import WorkspaceIndex

REPO = Path(__file__).resolve().parent.parent
SECRET = "outside_secret = 'TOPSECRET-7f3a9c'\n"
MARK = "TOPSECRET"

# Exchanges each pair of names in turn until the stop file exists; prints the swaps it made.
SWAPPER = textwrap.dedent(
    """
    import ctypes, os, sys
    stop, pairs = sys.argv[1], [p.split("|") for p in sys.argv[2:]]
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)

    def exchange(a, b):
        if atomic:
            renameat2(-100, a.encode(), -100, b.encode(), 2)  # AT_FDCWD, RENAME_EXCHANGE
        else:  # a kernel or file system without RENAME_EXCHANGE: three renames
            os.rename(a, a + ".t")
            os.rename(b, a)
            os.rename(a + ".t", b)

    atomic = renameat2 is not None and renameat2(-100, pairs[0][0].encode(), -100, pairs[0][1].encode(), 2) == 0
    print("ready", flush=True)
    n = 0
    while n % 64 or not os.path.exists(stop):
        a, b = pairs[n % len(pairs)]
        exchange(a, b)
        n += 1
    print(n, "atomic" if atomic else "renames")
    """
)


@contextmanager
def swapping(pairs: list[tuple[Path, Path]], tmp: Path) -> Iterator[dict]:
    """Runs the swapper over `pairs` for the body; the dict gets its swap count afterwards."""
    stop = tmp / "stop-swapping"
    proc = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(stop), *(f"{a}|{b}" for a, b in pairs)],
        stdout=subprocess.PIPE,
        text=True,
    )
    got: dict = {}
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # swapping before the walks start
    try:
        yield got
    finally:
        stop.touch()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    n, how = out.split()
    got.update(swaps=int(n), how=how)


def _workspace(tmp_path: Path) -> tuple[Path, list[tuple[Path, Path]]]:
    """A workspace with a file and a folder, each paired with a hidden link (the walk skips hidden
    names) to a file and a folder outside holding the secret: the pairs the swapper exchanges."""
    root, outside = tmp_path / "ws", tmp_path / "outside"
    (root / "pkg").mkdir(parents=True)
    (outside / "pkg").mkdir(parents=True)
    (outside / "secret.py").write_text(SECRET)
    (outside / "pkg" / "mod.py").write_text(SECRET)
    (root / "app.py").write_text("def app_main():\n    return victim_value\n")
    (root / "victim.py").write_text("victim_value = 1\n")
    (root / "pkg" / "mod.py").write_text("mod_value = 2\n")
    os.symlink(outside / "secret.py", root / ".victim")
    os.symlink(outside / "pkg", root / ".pkg")
    return root, [(root / "victim.py", root / ".victim"), (root / "pkg", root / ".pkg")]


def _exchange(a: Path, b: Path) -> None:
    os.rename(a, str(a) + ".t")
    os.rename(b, a)
    os.rename(str(a) + ".t", b)


def _handed_on(ws: WorkspaceIndex, sent: list[dict], root: Path) -> list[str]:
    """Every text the walker gave away: the snippet index's, the memory's, a fill's cross-file text."""
    texts = [t for index in ws._indexes.values() for t in index._texts.values()]
    texts += [t for ch in sent for t in ch.values() if t is not None]
    query = "x = outside_secret + victim_value + mod_value\n"
    texts.append(ws.cross_file((root / "new.py").as_uri(), query, len(query), "python", [], 24000) or "")
    return texts


def _after_stat(monkeypatch, suffix: str, action) -> dict:
    """The workspace module's `os` runs `action` once, right after the walker's stat (or lstat) of
    a path ending in `suffix`: between its check and its open. The dict says whether it ran."""
    armed = {"ran": False}

    def then_act(real):
        def checked(path, *args, **kwargs):
            st = real(path, *args, **kwargs)
            if os.fspath(path).endswith(suffix) and not armed["ran"]:
                armed["ran"] = True
                action()
            return st

        return checked

    class ActAfterStat:
        stat, lstat = staticmethod(then_act(os.stat)), staticmethod(then_act(os.lstat))

        def __getattr__(self, name):
            return getattr(os, name)

    monkeypatch.setattr(W, "os", ActAfterStat())
    return armed


def test_a_swap_between_stat_and_open_reads_nothing_outside(tmp_path, monkeypatch):
    """The race without the race: the file, then the folder, is exchanged for a link to outside
    right after the walker checked it. The walker skips it; it reads the other files."""
    root, pairs = _workspace(tmp_path)
    armed = _after_stat(monkeypatch, "victim.py", lambda: _exchange(*pairs[0]))
    ws = WorkspaceIndex([root], yield_s=0)
    sent: list[dict] = []
    ws.on_files = sent.append
    ws.scan()
    assert armed["ran"]  # the swap happened
    texts = _handed_on(ws, sent, root)
    assert not [t for t in texts if MARK in t]
    assert any("mod_value" in t for t in texts)  # the rest was read

    # the folder: listed as a folder by the walk, a link to outside by the time its files are read
    _exchange(*pairs[0])  # victim.py is the workspace's file again
    monkeypatch.setattr(W, "os", os)
    ws = WorkspaceIndex([root], yield_s=0)
    walk = ws.files

    def walk_then_swap():
        found = walk()
        _exchange(*pairs[1])
        return found

    ws.files = walk_then_swap  # type: ignore[method-assign]
    sent = []
    ws.on_files = sent.append
    ws.scan()
    assert (root / "pkg").is_symlink()
    texts = _handed_on(ws, sent, root)
    assert not [t for t in texts if MARK in t]
    assert any("victim_value = 1" in t for t in texts)


def test_a_file_grown_past_the_cap_after_its_check_is_skipped_unread(tmp_path, monkeypatch):
    """The size cap holds for what is read, not what lstat said: a file that grows past it
    between the check and the read costs max_file_bytes + 1 bytes and is left out."""
    (tmp_path / "small.py").write_text("small_value = 1\n")
    (tmp_path / "grows.py").write_text("grows_value = 1\n")
    cap = 1000

    def grow():
        with open(tmp_path / "grows.py", "a") as f:
            f.write("grown_value = 2\n" * 100_000)  # 1.6 MB

    armed = _after_stat(monkeypatch, "grows.py", grow)
    ws = WorkspaceIndex([tmp_path], yield_s=0, max_file_bytes=cap)
    assert ws.scan() == 1 and armed["ran"]
    assert ws._indexes["python"].sources() == [(tmp_path / "small.py").as_uri()]
    assert ws.bytes_read == len("small_value = 1\n") + cap + 1


WALKS = 400


def test_walks_while_files_and_folders_are_swapped_for_links_never_read_outside(tmp_path):
    """WALKS walks, each by a fresh index (so every file is read), while a process swaps the
    workspace's file and folder for links to a secret outside: not one text handed on holds it."""
    root, pairs = _workspace(tmp_path)
    leaked, victim_reads = [], 0
    with swapping(pairs, tmp_path) as swaps:
        for _ in range(WALKS):
            ws = WorkspaceIndex([root], yield_s=0)
            sent: list[dict] = []
            ws.on_files = sent.append
            ws.scan()
            texts = _handed_on(ws, sent, root)
            leaked += [t for t in texts if MARK in t]
            victim_reads += any("victim_value = 1" in t for t in texts)
    print(f"{WALKS} walks, {swaps['swaps']} swaps ({swaps['how']}), the victim read in {victim_reads}")
    assert swaps["swaps"] > WALKS  # the swaps ran through the walks
    assert victim_reads > 0  # the walks did read the file being swapped, when it was the workspace's
    assert not leaked, f"{len(leaked)} texts from outside the workspace, e.g. {leaked[0]!r}"


# Walks in a process of its own (an unbounded read must not take the test runner with it), with a
# data limit; prints what it read: the process's rchar (/proc/self/io) around the walks, the
# walker's count, and the texts it indexed. With pairs (victim|other), each walk swaps every victim
# for its other right after the walker's stat of it, and back before the next walk.
WALKER = textwrap.dedent(
    """
    import json, os, resource, stat, sys
    from pathlib import Path
    resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
    from dlm_lsp.fill import workspace as W

    def rchar():
        try:
            with open("/proc/self/io") as f:
                return int(next(line for line in f if line.startswith("rchar:")).split()[1])
        except OSError:
            return -1

    def exchange(a, b):
        os.rename(a, a + ".t")
        os.rename(b, a)
        os.rename(a + ".t", b)

    root, walks, pairs, swaps = Path(sys.argv[1]), int(sys.argv[2]), [p.split("|") for p in sys.argv[3:]], 0

    def then_swap(real):
        def checked(path, *args, **kwargs):
            global swaps
            st = real(path, *args, **kwargs)
            for a, b in pairs:
                if os.fspath(path).endswith(os.path.basename(a)):
                    exchange(a, b)
                    swaps += 1
            return st
        return checked

    class SwapAfterStat:
        stat, lstat = staticmethod(then_swap(os.stat)), staticmethod(then_swap(os.lstat))
        def __getattr__(self, name):
            return getattr(os, name)

    if pairs:
        W.os = SwapAfterStat()
    before, texts, counted = rchar(), set(), 0
    for _ in range(walks):
        for a, b in pairs:
            if not stat.S_ISREG(os.lstat(a).st_mode):
                exchange(a, b)
        ws = W.WorkspaceIndex([root], yield_s=0)
        ws.scan()
        texts |= {t for index in ws._indexes.values() for t in index._texts.values()}
        counted += getattr(ws, "bytes_read", 0)
    after = rchar()
    print(json.dumps({"rchar": after - before if before >= 0 else None, "counted": counted,
                      "texts": sorted(texts), "swaps": swaps}))
    """
)


@pytest.mark.parametrize("exact", [False, True], ids=["racing", "between-stat-and-open"])
def test_swaps_to_a_fifo_and_a_device_read_nothing_unbounded(tmp_path, exact):
    """Files swapped for a FIFO (no writer: a blocking open would hang the walk), a link to
    /dev/zero and, where this process may make one, a /dev/zero device node, by a racing process
    or right after each check: the walks end, and read no more than the workspace's own bytes."""
    root = tmp_path / "ws"
    root.mkdir()
    own = {"app.py": "def app_main():\n    return 1\n"}
    own.update({f"victim_{kind}.py": f"victim_{kind} = 1\n" for kind in ("fifo", "zero", "dev")})
    for name, text in own.items():
        (root / name).write_text(text)
    os.mkfifo(root / ".fifo")
    os.symlink("/dev/zero", root / ".zero")
    pairs = [(root / "victim_fifo.py", root / ".fifo"), (root / "victim_zero.py", root / ".zero")]
    try:
        os.mknod(root / ".dev", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        pairs.append((root / "victim_dev.py", root / ".dev"))
    except (OSError, AttributeError):
        (root / "victim_dev.py").unlink()
        del own["victim_dev.py"]
    walks = 200

    def walk(*hooked: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", WALKER, str(root), str(walks), *hooked],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,  # a hang guard only: the walks take about a second
        )

    if exact:
        done = walk(*(f"{a}|{b}" for a, b in pairs))
    else:
        with swapping(pairs, tmp_path) as swaps:
            done = walk()
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    n = got["swaps"] if exact else swaps["swaps"]
    print(
        f"{walks} walks, {n} swaps ({'after each stat' if exact else swaps['how']}) of {len(pairs)} pairs, "
        f"{got['counted']} bytes read ({got['rchar']} by rchar)"
    )
    assert n >= walks * len(pairs) if exact else n > walks
    assert set(got["texts"]) <= set(own.values())  # nothing but the workspace's own texts
    most = walks * sum(len(t) for t in own.values())
    assert got["counted"] <= most
    if got["rchar"] is not None:  # every read the process made, whichever way the walker reads
        assert got["rchar"] <= most + 65536, got["rchar"]
