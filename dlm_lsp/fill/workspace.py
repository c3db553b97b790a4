"""The workspace's files as cross-file context: the chunks of the project's other files (open or not)
that look most like the code at the cursor (dlm_lsp.fill.retrieval), as Tabby and Continue retrieve from
the repository, for the copy boost's far side and the identifier-aware decoding.

`WorkspaceIndex` walks the editor's workspace folders (InitializeParams rootUri / workspaceFolders)
in a background thread: files of the served languages only (by extension), at most MAX_FILES of
them, MAX_FILE_BYTES each and MAX_TOTAL_BYTES in all, MAX_ENTRIES directory entries looked at, no
symbolic links followed, no hidden, dependency, build or cache folders, nothing that is not UTF-8
text; and only regular files inside the folders, even while another process swaps names for links,
FIFOs or devices as it walks (`walk_folders`, `read_regular`). It walks again every RESCAN_S
seconds and re-reads only files whose size or mtime changed (deleted ones leave the index). Open
documents are indexed from the editor's text instead of the disk's, when a fill asks and their
version changed.

When a limit binds (a big repository: more files than MAX_FILES, more text than MAX_TOTAL_BYTES,
more than the engine's workspace memory holds), the files taken are the nearest to where the user
works, not the first in walk order: the walk orders the files it found by their folder's distance
in the tree to the folders of the documents filled in and open beside them (`focus`), nearest
first (then the most recent of those folders first, then walk order). A fill in a folder the last
such walk did not favour wakes the walker, which then drops the farthest files (from the snippets
and from the memory) for the nearest.

Measured on held-out code (docs/research/29-s20-workspace-snippets.md): snippets retrieved from the project's other
files against the start of 3 neighbouring files, +0.4 to +0.6 points of rest-of-line exact match and
more characters kept on every hole set; retrieval from the open neighbours alone was no better than
their starts, so without indexed workspace files the server keeps the starts
(context.neighbour_text).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from dlm_lsp.fill.documents import language_id_for_path, uri_key
from dlm_lsp.fill.retrieval import SnippetIndex, cross_file_text

if TYPE_CHECKING:
    from dlm_lsp.fill.documents import Document

# the engine's workspace memory: {source: its text, or None when it left the workspace}
FilesSink = Callable[[dict[str, str | None]], object]

log = logging.getLogger("dlm.workspace")

MAX_FILES = 5000  # files indexed over all folders
MAX_FILE_BYTES = 200_000  # bigger files are generated or data, as the corpus filter has it
MAX_TOTAL_BYTES = 64_000_000  # text indexed over all files (a walk stops taking files past it)
MAX_ENTRIES = 200_000  # directory entries a walk looks at (a home folder opened as a workspace)
# text given to the engine's workspace memory (on_files: the workspace's n-gram), about the memory's
# 1 M-token cap (engine.bias.ngram.WORKSPACE_MAX_TOKENS): files past it, nearest to the focus first, are not sent
MEMORY_CHARS = 4_000_000
RESCAN_S = 60.0
MAX_FOCUS = 8  # folders of recently filled and open documents the walk orders files by
YIELD_S = 0.001  # the walker sleeps this long after each file read, so fills keep the interpreter
MAX_DEPTH = 64  # folders below a root the walk enters (each holds a descriptor while its subfolders are walked)
SKIP_DIRS = frozenset(
    {
        "node_modules",
        "__pycache__",
        "site-packages",
        "dist-packages",
        "venv",
        "env",
        "build",
        "dist",
        "target",
        "_vendor",
        "vendored",
        "third_party",
        "htmlcov",
    }
)


# Another process may swap a name for a link, a FIFO or a device between the walk's check and its
# open (issue 39): folders and files are opened relative to the folder that listed them, never
# through a link, and a file is read only if its descriptor is the regular file the check saw.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)  # as named: the user's choice
_FOLDER_FLAGS = _ROOT_FLAGS | _NOFOLLOW
# O_NONBLOCK: a FIFO swapped in opens at once (and fstat refuses it) rather than wait for a writer
_FILE_FLAGS = (
    os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
)
# POSIX walks by descriptor; elsewhere (Windows) by path, every file still checked by fstat
BY_DESCRIPTOR = bool(_NOFOLLOW) and {os.open, os.stat} <= os.supports_dir_fd and os.scandir in os.supports_fd


def read_regular(
    name: str | Path, cap: int, dir_fd: int | None = None, expect: os.stat_result | None = None
) -> bytes | None:
    """The regular file `name` (in the folder `dir_fd`), its first cap + 1 bytes at most (one more
    than `cap` says it is over the cap, unread past it); None for a link, a FIFO, a device, a file
    other than the one `expect` (its lstat) saw, or one that cannot be read."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (expect is not None and not os.path.samestat(st, expect)):
            return None
        parts, left = [], cap + 1
        while left > 0:
            part = os.read(fd, left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
        return b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)


def _walked(name: str) -> bool:
    return not name.startswith(".") and name not in SKIP_DIRS


def walk_folders(root: Path) -> Generator[tuple[Path, int, list[str]], None, None]:
    """(folder, entries looked at, its files' names sorted) for `root` and the folders below it,
    top-down, subfolders in sorted order, hidden and SKIP_DIRS folders pruned, no link followed. By
    descriptor, a folder is opened relative to its parent's with O_NOFOLLOW (so one swapped for a
    link after it was listed is not entered) and its files are regular files by their directory
    entry; by path (os.walk) links are still listed, and the read refuses them."""
    if not BY_DESCRIPTOR:
        for top, dirs, names in os.walk(root, followlinks=False):
            dirs[:] = sorted(filter(_walked, dirs))
            yield Path(top), len(dirs) + len(names), sorted(names)
        return
    try:
        fd = os.open(root, _ROOT_FLAGS)
    except OSError:
        return
    try:
        yield from _walk_below(root, fd, 0)
    finally:
        os.close(fd)


def _walk_below(folder: Path, fd: int, depth: int) -> Generator[tuple[Path, int, list[str]], None, None]:
    try:
        with os.scandir(fd) as listing:
            entries = list(listing)
    except OSError:
        return
    dirs, names, others = [], [], 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                if _walked(entry.name):
                    dirs.append(entry.name)
            elif entry.is_file(follow_symlinks=False):
                names.append(entry.name)
            else:
                others += 1
        except OSError:
            others += 1
    yield folder, len(dirs) + len(names) + others, sorted(names)
    if depth >= MAX_DEPTH:
        return
    for name in sorted(dirs):
        try:
            sub = os.open(name, _FOLDER_FLAGS, dir_fd=fd)
        except OSError:  # gone, or swapped for a link since it was listed
            continue
        try:
            yield from _walk_below(folder / name, sub, depth + 1)
        finally:
            os.close(sub)


class _Folders:
    """Stats and reads files below the walked roots, each from its folder's descriptor, opened from
    the root folder by folder with O_NOFOLLOW: a folder swapped for a link is not read through. A
    walk's files come folder by folder, so one descriptor is kept, for the latest folder."""

    def __init__(self, roots: list[Path]):
        self.roots = roots
        self._at: Path | None = None
        self._fd: int | None = None

    def _open(self, folder: Path) -> int | None:
        if folder == self._at:
            return self._fd
        self.close()
        self._at = folder
        root = next((r for r in self.roots if folder.is_relative_to(r)), None)
        if root is None:
            return None
        try:
            fd = os.open(root, _ROOT_FLAGS)
        except OSError:
            return None
        for name in folder.relative_to(root).parts:
            try:
                sub = os.open(name, _FOLDER_FLAGS, dir_fd=fd)
            except OSError:
                os.close(fd)
                return None
            os.close(fd)
            fd = sub
        self._fd = fd
        return fd

    def lstat(self, path: Path) -> os.stat_result | None:
        try:
            if not BY_DESCRIPTOR:
                return os.lstat(path)
            fd = self._open(path.parent)
            return None if fd is None else os.stat(path.name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None

    def read(self, path: Path, cap: int, expect: os.stat_result) -> bytes | None:
        if not BY_DESCRIPTOR:
            return read_regular(path, cap, expect=expect)
        fd = self._open(path.parent)
        return None if fd is None else read_regular(path.name, cap, fd, expect)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._at = self._fd = None


def uri_path(uri: object) -> Path | None:
    """The absolute local path of a file URI (not resolved: it must match the walk's paths), else None."""
    if not isinstance(uri, str) or not uri.startswith("file:"):
        return None
    path = Path(unquote(urlparse(uri).path))
    if os.name == "nt" and str(path).startswith("\\") and ":" in str(path)[:4]:
        path = Path(str(path)[1:])
    return Path(os.path.abspath(path))


def nearness(folder: Path, focus: list[Path]) -> tuple[int, int]:
    """How near `folder` is to the focus (folders, most recent first): the steps up and down the
    folder tree to the nearest of them (0: the same folder; 1: parent or child; 2: a sibling), then
    that folder's place in `focus`; (0, 0) when there is no focus. Smaller is nearer."""
    parts = folder.parts
    best = (0, 0)
    for i, f in enumerate(focus):
        other = f.parts
        common = 0
        for a, b in zip(parts, other):
            if a != b:
                break
            common += 1
        key = (len(parts) + len(other) - 2 * common, i)
        best = key if i == 0 else min(best, key)
    return best


def root_paths(root_uri: object, folders: Iterable[object] | None) -> list[Path]:
    """Local folders of an InitializeParams' workspaceFolders (else its rootUri): file URIs only,
    existing directories, each once."""
    uris = [getattr(f, "uri", None) for f in (folders or [])] or [root_uri]
    out: list[Path] = []
    for uri in uris:
        path = uri_path(uri)  # not resolved: sources must match the editor's URIs, links and all
        if path is not None and path.is_dir() and path not in out:
            out.append(path)
    return out


class WorkspaceIndex:
    """Snippet indexes of the workspace's files, one per languageId, kept current by a thread."""

    def __init__(
        self,
        roots: list[Path],
        serves: Callable[[str], bool] = lambda language_id: True,
        max_files: int = MAX_FILES,
        max_file_bytes: int = MAX_FILE_BYTES,
        rescan_s: float = RESCAN_S,
        yield_s: float = YIELD_S,
        max_total_bytes: int = MAX_TOTAL_BYTES,
        max_entries: int = MAX_ENTRIES,
    ):
        self.roots, self.serves = [Path(os.path.abspath(r)) for r in roots], serves
        self.max_files, self.max_file_bytes, self.rescan_s, self.yield_s = max_files, max_file_bytes, rescan_s, yield_s
        self.max_total_bytes, self.max_entries = max_total_bytes, max_entries
        self._lock = threading.Lock()
        self._indexes: dict[str, SnippetIndex] = {}
        self._seen: dict[str, tuple[str, int, int]] = {}  # disk source -> (languageId, size, mtime_ns)
        self._open: dict[str, tuple[str, int]] = {}  # open document source -> (languageId, version) indexed
        self._disk: dict[str, int] = {}  # languageId -> sources in _seen (changed under the lock)
        self._stop = threading.Event()
        self._wake = threading.Event()  # set_roots: walk now, not at the next RESCAN_S
        self._thread: threading.Thread | None = None
        self.scans = 0
        self.bytes_read = 0  # read from disk by the walks: at most max_file_bytes + 1 a file
        self._walked_roots: list[Path] = []  # the roots the latest files() walked
        # the engine's workspace memory (set_sink): fn({source: text, or None when it left}) after a
        # walk that changed files, on this thread; what was sent, by size
        self.on_files: FilesSink | None = None
        self._sent: dict[str, int] = {}
        self._unremoved: set[str] = set()  # removals a failed send did not deliver: sent again next walk
        # folders of the documents filled in and open (most recent first), the walk's order; whether
        # the last finished walk left files out by a limit; the focus the latest walk orders by; whether
        # the latest files() left some out
        self._focus: list[Path] = []
        self._truncated = False
        self._walked_focus: list[Path] = []
        self._cut = False
        self._focused_uris: tuple[tuple[str, ...], list[Path]] = (
            (),
            [],
        )  # the last focus() call's documents and their folders

    def start(self) -> None:
        if self._thread is None and self.roots:
            self._thread = threading.Thread(target=self._run, name="dlm-workspace", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def set_roots(self, roots: list[Path]) -> None:
        """The workspace folders changed (workspace/didChangeWorkspaceFolders): the thread walks the
        new set at once; files of a removed folder leave the index in that walk, an added folder's
        come in. The same set again changes nothing."""
        roots = [Path(os.path.abspath(r)) for r in roots]
        if roots == self.roots:
            return
        self.roots = roots  # one assignment: a walk under way sees the old list or the new one
        self._wake.set()
        self.start()

    def set_sink(self, on_files: FilesSink | None) -> None:
        """Feeds the engine's workspace memory (DecodeOptions.workspace_ngram): the next walk reads
        every file again for `on_files` (a new engine has none; up to MEMORY_CHARS), then each walk
        gives it the files it changed. Open documents are not sent (the filled one never counts).
        None stops it."""
        with self._lock:
            self.on_files = on_files
            self._sent = {}
            self._unremoved = set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.scan()
            except Exception:  # a walk that fails leaves the last index; the next one tries again
                log.exception("workspace scan failed")
            self._wake.wait(self.rescan_s)

    def focus(self, uris: Iterable[str]) -> None:
        """The documents `uris` are being filled in or are open beside the one that is: their folders
        go to the front of the walk's order. When the last walk left files out by a limit and ordered
        them by another focus, the walker walks again now."""
        uris = tuple(uris)
        if uris != self._focused_uris[0]:  # every keystroke's fill asks with the same documents: parsed once
            self._focused_uris = (uris, [p.parent for p in map(uri_path, uris) if p is not None])
        folders = self._focused_uris[1]
        if not folders:
            return
        with self._lock:
            self._focus = list(dict.fromkeys(folders + self._focus))[:MAX_FOCUS]
            stale = self._truncated and not set(folders) <= set(self._walked_focus)
        if stale:
            self._wake.set()

    def files(self) -> list[tuple[Path, str]]:
        """(path, languageId) of the files to index (walk_folders): served languages, regular files,
        hidden and dependency folders pruned, sorted within each folder; at most max_files of them,
        the nearest to the focus's folders first (ties in walk order)."""
        out: list[tuple[Path, str]] = []
        seen = 0
        with self._lock:
            focus = list(self._focus)
        self._walked_focus = focus
        self._cut = False
        self._walked_roots = roots = list(self.roots)
        for root in roots:
            with closing(walk_folders(root)) as folders:  # closing: the walk's folder descriptors
                for top, looked, names in folders:
                    seen += looked
                    if seen > self.max_entries:
                        log.info("workspace walk stopped after %d entries (%d files found)", seen, len(out))
                        self._cut = True
                        return self._nearest(out, focus)
                    for name in names:
                        lang = language_id_for_path(name)
                        if lang == "plaintext" or name.startswith(".") or not self.serves(lang):
                            continue
                        out.append((top / name, lang))
                        if len(out) > self.max_files and not focus:
                            self._cut = True
                            return out[: self.max_files]
        return self._nearest(out, focus)

    def _nearest(self, found: list[tuple[Path, str]], focus: list[Path]) -> list[tuple[Path, str]]:
        if len(found) > self.max_files:
            self._cut = True
        if focus:
            near: dict[Path, tuple[int, int]] = {}
            for path, _ in found:
                if path.parent not in near:
                    near[path.parent] = nearness(path.parent, focus)
            found = sorted(found, key=lambda f: near[f[0].parent])  # stable: walk order among equals
        return found[: self.max_files]

    def scan(self) -> int:
        """One walk: indexes new and changed files, drops deleted ones; returns files (re)read."""
        read = 0
        total = 0
        present: set[str] = set()
        sink = self.on_files
        changed: dict[str, str | None] = {}
        memory = 0  # bytes of the files the memory should hold, nearest first
        wanted: set[str] = set()
        files = self.files()
        cut = (
            self._cut
        )  # a limit left files out (set by the end of the walk: a focus() meanwhile reads the last walk's)
        folders = _Folders(self._walked_roots)
        try:
            for path, lang in files:
                if self._stop.is_set():
                    return read
                st = folders.lstat(path)
                if st is None or not stat.S_ISREG(st.st_mode) or st.st_size > self.max_file_bytes:
                    continue
                total += st.st_size
                if total > self.max_total_bytes:
                    cut = True
                    break
                source = uri_key(path.as_uri())
                present.add(source)
                unchanged = self._seen.get(source) == (lang, st.st_size, st.st_mtime_ns)
                want = sink is not None and memory + st.st_size <= MEMORY_CHARS
                if want:
                    memory += st.st_size
                    wanted.add(source)
                elif sink is not None:
                    cut = True
                unsent = want and source not in self._sent
                if source in self._open or (unchanged and not unsent):
                    continue
                data = folders.read(path, self.max_file_bytes, st)
                self.bytes_read += len(data or b"")
                if data is None or len(data) > self.max_file_bytes:  # swapped, or grown past the cap
                    continue
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if "\0" in text:
                    continue
                with self._lock:
                    if source in self._open:  # opened while it was read: the editor's text wins
                        continue
                    if not unchanged:
                        self._index(lang).add(source, text)
                        self._mark(source, (lang, st.st_size, st.st_mtime_ns))
                if want:
                    self._sent[source] = len(text)
                    changed[source] = text
                read += 1
                if self.yield_s:
                    time.sleep(self.yield_s)
        finally:
            folders.close()
        with self._lock:
            for source in [s for s in self._seen if s not in present]:
                lang = self._seen[source][0]
                self._mark(source, None)
                self._index(lang).remove(source)
            for source in [s for s in self._sent if s not in wanted]:  # gone, or past the budget now
                del self._sent[source]
                changed[source] = None
            for source in self._unremoved:
                changed.setdefault(source, None)
            self._unremoved = set()
        # removals first: a shared engine gets big sends in parts, and a part's files past the
        # memory's cap would be refused before a later part made room
        changed = {
            **{k: t for k, t in changed.items() if t is None},
            **{k: t for k, t in changed.items() if t is not None},
        }
        self._truncated = cut
        if sink is not None and changed and sink is self.on_files:
            try:
                sink(changed)
            except (
                Exception
            ):  # a quality lever: the walk and the snippets go on without it; the next walk sends them again
                log.exception("the engine's workspace memory was not updated")
                with self._lock:
                    for source, sent in changed.items():
                        self._sent.pop(source, None)
                        if sent is None:  # else the engine would keep a file past the budget and refuse nearer ones
                            self._unremoved.add(source)
        self.scans += 1
        return read

    def _index(self, lang: str) -> SnippetIndex:
        index = self._indexes.get(lang)
        if index is None:
            index = self._indexes[lang] = SnippetIndex()
        return index

    def _mark(self, source: str, seen: tuple[str, int, int] | None) -> None:
        """Sets (or with None forgets) what was read of `source` from disk; holds the lock."""
        old = self._seen.pop(source, None)
        if old is not None:
            self._disk[old[0]] -= 1
        if seen is not None:
            self._seen[source] = seen
            self._disk[seen[0]] = self._disk.get(seen[0], 0) + 1

    def disk_files(self, language_id: str) -> int:
        """Workspace files of `language_id` indexed from disk."""
        return self._disk.get(language_id, 0)

    def cross_file(
        self, uri: str, text: str, offset: int, language_id: str, open_docs: Sequence[Document], limit_chars: int
    ) -> str | None:
        """The far text of a fill at str `offset` of the document `uri` (whose text is `text`): the
        most similar chunks of the workspace's other files, the open documents `open_docs` (other
        documents of the language) read from the editor. None when no file of the language is
        indexed from disk yet (the caller keeps the open documents' starts)."""
        self.focus([uri] + [doc.uri for doc in open_docs])
        if not self.disk_files(language_id):
            return None
        me = uri_key(uri)
        with self._lock:
            index = self._index(language_id)
            for doc in open_docs:
                source = uri_key(doc.uri)
                if source != me and self._open.get(source) != (language_id, doc.version):
                    index.add(source, doc.text)
                    self._open[source] = (language_id, doc.version)
                    self._mark(source, None)  # the disk copy is re-read after the document closes
            return cross_file_text(index, text, offset, limit_chars, exclude=me)

    def closed(self, uri: str) -> None:
        """A document closed: its editor text leaves the index; the next walk reads the disk's."""
        source = uri_key(uri)
        with self._lock:
            got = self._open.pop(source, None)
            if got is not None:
                self._index(got[0]).remove(source)
