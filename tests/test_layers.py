"""The house's layers (docs/ARCHITECTURE.md, "Invariants"): every import of the product, function-level
included, read from the source, and held against the rules. A failure names the file and line.

Imports under `if TYPE_CHECKING:` are left out: they never run, and only annotate.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "dlm_lsp", "kernels")
LSP_LIBS = ("pygls", "lsprotocol")
TREE_SITTER = "tree_sitter"  # and every grammar package, tree_sitter_python ...
TORCH_LIBS = ("torch", "triton", "safetensors.torch", "transformers")
# the only modules that may import pygls / lsprotocol, and the CLI (its command table names measure programs)
LSP_FACES = {"dlm_lsp.server", "dlm_lsp.protocol"}
CLI = "dlm_lsp.cli"


@dataclass
class Module:
    name: str
    path: Path  # relative to the tree's root
    imports: list[tuple[str, int]] = field(default_factory=list)  # (dotted name as written, line)
    paths: list[tuple[str, int]] = field(default_factory=list)  # string literals naming tests/ or scripts/


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def read_modules(root: Path, packages=PRODUCT) -> dict[str, Module]:
    """Every module of `packages` under `root`, with its imports (function-level included) and the
    string literals that name the tests/ or scripts/ folders."""
    mods: dict[str, Module] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            if is_init:
                parts = parts[:-1]
            name = ".".join(parts)
            m = Module(name, path.relative_to(root))
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            skip = _type_checking_lines(tree)
            here = name if is_init else name.rpartition(".")[0]
            for node in ast.walk(tree):
                if getattr(node, "lineno", None) in skip:
                    continue
                if isinstance(node, ast.Import):
                    m.imports += [(a.name, node.lineno) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        up = here.split(".")[: len(here.split(".")) - node.level + 1]
                        base = ".".join(up + ([node.module] if node.module else []))
                    m.imports.append((base, node.lineno))
                    m.imports += [(f"{base}.{a.name}", node.lineno) for a in node.names]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    v = node.value
                    if v in ("tests", "scripts") or v.startswith(("tests/", "scripts/", "tests.", "scripts.")):
                        m.paths.append((v, node.lineno))
            mods[name] = m
    return mods


def edges(mods: dict[str, Module]) -> dict[str, list[tuple[str, int]]]:
    """Module -> the product modules it imports (a `from pkg import name` of a submodule counts as
    importing that submodule), with the line."""
    out: dict[str, list[tuple[str, int]]] = {}
    for m in mods.values():
        seen = []
        for target, line in m.imports:
            if target in mods and target != m.name:
                seen.append((target, line))
        out[m.name] = seen
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _external(target: str, lib: str) -> bool:
    return target == lib or target.startswith(lib + ".")


def reach(mods, start: str) -> dict[str, list[str]]:
    """Every product module `start` loads, transitively, each with one import chain from `start`
    ("file:line imports X" per link)."""
    graph = edges(mods)
    chains = {start: []}
    todo = [start]
    while todo:
        cur = todo.pop()
        for target, line in graph[cur]:
            if target not in chains:
                chains[target] = chains[cur] + [f"{mods[cur].path.name}:{line} ({cur}) imports {target}"]
                todo.append(target)
    return chains


def cycles(mods) -> list[list[str]]:
    """The import circles (strongly connected components of 2+ modules, or a module importing itself)."""
    graph = {k: [t for t, _ in v] for k, v in edges(mods).items()}
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(mods: dict[str, Module]) -> list[str]:
    """Every broken invariant, one line each, naming the file and line that breaks it."""
    bad: list[str] = []
    loads_torch = {}  # module -> (lib, line) of its own torch import
    for m in mods.values():
        for target, line in m.imports:
            lib = next((x for x in TORCH_LIBS if _external(target, x)), None)
            if lib and m.name not in loads_torch:
                loads_torch[m.name] = (lib, line)
    for m in mods.values():
        where = str(m.path)
        for target, line in m.imports:
            if any(_external(target, lib) for lib in LSP_LIBS) and m.name not in LSP_FACES:
                bad.append(
                    f"{where}:{line}: imports {target}: only dlm_lsp/server.py and dlm_lsp/protocol.py speak LSP"
                )
            if _external(target, TREE_SITTER) or target.startswith(TREE_SITTER + "_"):
                if not _under(m.name, "dlm_lsp"):
                    bad.append(f"{where}:{line}: imports {target}: only dlm_lsp/ reads syntax trees")
            if _under(target, "dlm_lsp.measure") and not _under(m.name, "dlm_lsp.measure") and m.name != CLI:
                bad.append(
                    f"{where}:{line}: imports {target}: only dlm_lsp/measure and the CLI's table use measure programs"
                )
            if _external(target, "tests") or _external(target, "scripts"):
                bad.append(f"{where}:{line}: imports {target}: the product never imports tests/ or scripts/")
        for text, line in m.paths:
            bad.append(f"{where}:{line}: names {text!r}: the product never reads tests/ or scripts/")
        layer_rules = []
        if _under(m.name, "engine.serve") or _under(m.name, "engine.decode"):
            layer_rules.append(("engine.train", "serving and decoding never load training code"))
        if _under(m.name, "engine.train"):
            layer_rules += [
                ("engine.decode", "training never loads decoding"),
                ("engine.serve", "training never loads serving"),
            ]
        if layer_rules:
            for target, chain in reach(mods, m.name).items():
                for layer, why in layer_rules:
                    if _under(target, layer):
                        bad.append(f"{where}: loads {target}: {why}: " + " -> ".join(chain))
        if _under(m.name, "engine.clients"):
            for target, chain in reach(mods, m.name).items():
                if target in loads_torch:
                    lib, line = loads_torch[target]
                    bad.append(
                        f"{where}: loads {lib} ({mods[target].path.name}:{line}): engine/clients never loads torch: "
                        + " -> ".join(chain or ["itself"])
                    )
    for comp in cycles(mods):
        bad.append("import circle: " + " <-> ".join(comp))
    return sorted(set(bad))


# ---------------------------------------------------------------- the product


def test_the_product_keeps_every_layer():
    bad = violations(read_modules(ROOT))
    assert not bad, "\n".join(bad)


def test_the_command_table_names_modules_that_exist():
    """The CLI imports its subcommands by name (strings): each must be a module of the product."""
    from dlm_lsp.cli import COMMANDS

    mods = read_modules(ROOT)
    missing = [f"{cmd}: {mod}" for cmd, (mod, *_rest) in COMMANDS.items() if mod not in mods]
    assert not missing, missing


def test_the_clients_run_without_torch():
    """What the layer rule reads from the source, checked in a process: the remote engines import
    without torch."""
    code = (
        "import sys; import engine.clients.remote, engine.clients.http_engine, engine.clients.wire; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- the checker itself


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    for pkg in PRODUCT:
        (tmp_path / pkg).mkdir(exist_ok=True)
    return read_modules(tmp_path)


CLEAN = {
    "engine/__init__.py": "",
    "engine/decode/__init__.py": "",
    "engine/decode/sampler.py": "import torch\nfrom engine.decode import canvas\n",
    "engine/decode/canvas.py": "import torch\n",
    "engine/train/__init__.py": "",
    "engine/model/__init__.py": "",
    "engine/model/config.py": "import json\n",
    "engine/train/loop.py": "from engine.model import config\n",
    "engine/serve/__init__.py": "",
    "engine/serve/service.py": "from engine.decode.sampler import step\n",
    "engine/clients/__init__.py": "",
    "engine/clients/wire.py": "import json\n",
    "dlm_lsp/__init__.py": "",
    "dlm_lsp/server.py": "import pygls\nfrom dlm_lsp.fill import context\n",
    "dlm_lsp/cli.py": "COMMANDS = {'eval': ('dlm_lsp.measure.evaluate', 'a', 'r', 'h')}\nfrom dlm_lsp.measure import evaluate\n",
    "dlm_lsp/fill/__init__.py": "",
    "dlm_lsp/fill/context.py": "import tree_sitter\n",
    "dlm_lsp/measure/__init__.py": "",
    "dlm_lsp/measure/evaluate.py": "from dlm_lsp.fill import context\n",
}

BREAKS = {  # invariant -> (file, text that breaks it, what the report must say)
    "decode loads training": (
        "engine/decode/canvas.py",
        "def f():\n    from engine.train import loop\n",
        "serving and decoding never load training code",
    ),
    "serve loads training through decode": (
        "engine/decode/sampler.py",
        "from engine.train.loop import x\n",
        "serving and decoding never load training code",
    ),
    "training loads serving": ("engine/train/loop.py", "import engine.serve.service\n", "training never loads serving"),
    "training loads decoding": (
        "engine/train/extra.py",
        "from engine.decode.sampler import step\n",
        "training never loads decoding",
    ),
    "clients load torch": (
        "engine/clients/wire.py",
        "def f():\n    import torch\n",
        "engine/clients never loads torch",
    ),
    "clients load torch through another module": (
        "engine/clients/remote.py",
        "from engine.decode import canvas\n",
        "engine/clients never loads torch",
    ),
    "pygls outside the server": ("dlm_lsp/fill/documents.py", "from lsprotocol import types\n", "speak LSP"),
    "tree-sitter in the engine": ("engine/holes.py", "import tree_sitter_python\n", "only dlm_lsp/ reads syntax trees"),
    "measure imported by the server": (
        "dlm_lsp/server.py",
        "import pygls\nfrom dlm_lsp.measure.evaluate import x\n",
        "only dlm_lsp/measure and the CLI",
    ),
    "the product imports tests": (
        "dlm_lsp/measure/fuzz.py",
        "from tests.lsp_fake_server import main\n",
        "never imports tests/ or scripts/",
    ),
    "the product reads a test file": (
        "dlm_lsp/measure/fuzz.py",
        "from pathlib import Path\nP = Path('x') / 'tests' / 'a.py'\n",
        "never reads tests/ or scripts/",
    ),
    "an import circle": (
        "engine/decode/canvas.py",
        "import torch\nfrom engine.decode import sampler\n",
        "import circle",
    ),
}


def test_the_checker_passes_a_clean_tree(tmp_path):
    assert violations(_tree(tmp_path, CLEAN)) == []


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_the_checker_finds_each_broken_invariant(tmp_path, name):
    path, text, says = BREAKS[name]
    bad = violations(_tree(tmp_path, {**CLEAN, path: text}))
    assert any(says in b for b in bad), bad
    if says != "import circle":
        assert any(Path(path).name in b for b in bad), bad  # the report names the offending file


def test_a_type_checking_import_is_not_a_layer_break(tmp_path):
    text = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.train.loop import x\n"
    assert violations(_tree(tmp_path, {**CLEAN, "engine/decode/canvas.py": text})) == []
