"""The intents a Python file holds for synthetic next edits (engine/train/synth_edits.py makes the
cases): each kind a function of a Source (engine/train/synth_source.py) giving Intents, the sites of
one intent top to bottom, each site (offset in the file, old, new). Every kind is correct by
construction: it works on code tokens, so a string or a comment is never touched, and it checks with
the tree what a token means (a parameter, a call, an import from `typing`) before it changes it.

    rename          a function's local (a parameter, or a name first bound in its body) at every
                    occurrence there, when the tree's occurrences are exactly the function's NAME tokens
                    that are not an attribute or a keyword argument; the new name derived from the old
                    (a synonym, a word abbreviated or spelled out, a word dropped, snake case), none the
                    function uses, no keyword or builtin
    add_param       a parameter appended to a plain module-level def, the same name passed by each call
                    of it below the def
    type_hint       a hint on a parameter that two or more methods of a class leave unannotated, in
                    each (the hint the file gives that name elsewhere, else one the name suggests)
    quote_style     a run of simple literals switched 'x' -> "x" (or back, where ' is the majority)
    typing_builtin  a run of one typing alias: Dict[ -> dict[ (List, Tuple, Set, FrozenSet, Type),
                    Optional[X] -> X | None

A run: sites each within REACH lines of the one before it (an intent in one stretch of code).
"""

from __future__ import annotations

import ast
import builtins
import keyword
import random
import re
import tokenize
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

from engine.train.edit_pairs import REACH, Edit
from engine.train.synth_source import Source

_TAKEN = set(dir(builtins)) | set(keyword.kwlist) | set(keyword.softkwlist) | {"self", "cls", "mcs"}
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPES = (*_FUNCS, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_DYNAMIC = {"locals", "vars", "eval", "exec"}  # a function reading its names by string keeps them

# interchangeable local names, and word abbreviations (a rename's new name is derived from the old)
SYNONYMS = [
    set(g.split(","))
    for g in "value,val result,res,out index,idx,pos count,num,total name,label data,payload path,filepath,location "
    "text,content,source items,entries,elements item,entry,element line,row lines,rows error,err,exc "
    "callback,func,fn start,begin end,stop size,length parts,pieces,chunks obj,instance node,child key,k i,j,n".split()
]
ABBREV = {
    a: b
    for a, b in (
        p.split(":")
        for p in "number:num index:idx value:val result:res message:msg config:cfg argument:arg arguments:args "
        "parameter:param parameters:params buffer:buf temporary:tmp source:src destination:dst previous:prev "
        "current:cur position:pos response:resp request:req context:ctx element:elem function:func "
        "attribute:attr reference:ref object:obj expression:expr variable:var error:err exception:exc "
        "information:info document:doc module:mod package:pkg directory:dir description:desc length:len count:cnt".split()
    )
}
EXPAND = {v: k for k, v in ABBREV.items()}
PARAM_NAMES = ("verbose", "timeout", "strict", "encoding", "limit", "callback", "prefix", "context", "options", "force")
FLAGS = {"verbose", "strict", "force", "quiet", "debug", "dry_run", "recursive"}  # their default is False
ALIASES = {"Dict": "dict", "List": "list", "Tuple": "tuple", "Set": "set", "FrozenSet": "frozenset", "Type": "type"}


@dataclass
class Intent:
    """One intent's sites, top to bottom, none overlapping; `complete` when no site of it lies outside
    `sites` (so after the last one nothing is left to change: a noise case may end there)."""

    kind: str
    sites: list[Edit]
    complete: bool = True


def runs(text: str, sites: list[Edit]) -> list[list[Edit]]:
    """Sites cut where one starts more than REACH lines after the one before it ends."""
    out: list[list[Edit]] = []
    for s in sites:
        if out and text.count("\n", out[-1][-1][0] + len(out[-1][-1][1]), s[0]) - 1 <= REACH:
            out[-1].append(s)
        else:
            out.append([s])
    return out


# ---------------------------------------------------------------------- rename


@lru_cache(maxsize=4096)
def _words(name: str) -> tuple[str, ...]:
    """snake_case or camelCase words, lower case."""
    if "_" in name or name.islower():
        return tuple(w for w in name.split("_") if w)
    return tuple(w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name))


def _usable(name: str, old: str, used: set[str]) -> bool:
    return name.isidentifier() and name != old and name not in used and name not in _TAKEN


def new_name(old: str, used: set[str], others: list[str], rng: random.Random) -> str | None:
    """A plausible new name for `old`, none of `used`: a synonym, a word abbreviated or spelled out, the
    name shortened by a word or in snake case; else a name of the file sharing a word with it."""
    lead = old[: len(old) - len(old.lstrip("_"))]
    ws = _words(old[len(lead) :])
    cands = set().union(*(g for g in SYNONYMS if old[len(lead) :] in g))
    for i, w in enumerate(ws):
        for v in (ABBREV.get(w), EXPAND.get(w)):
            if v:
                cands.add("_".join([*ws[:i], v, *ws[i + 1 :]]))
    if len(ws) > 1:
        cands |= {"_".join(ws), "_".join(ws[1:]), "_".join(ws[:-1])}
    ok = sorted(n for n in (lead + c for c in cands) if _usable(n, old, used))
    if not ok:
        ok = [n for n in others if set(_words(n.lstrip("_"))) & set(ws) and _usable(n, old, used)]
    return rng.choice(ok) if ok else None


def _names_in(src: Source, fn: ast.FunctionDef | ast.AsyncFunctionDef, nodes: list[ast.AST]) -> set[str]:
    """Every name the function's text holds: its NAME tokens, and the names of its tree (those inside an
    f-string too, which are no tokens here)."""
    toks = {src.toks[i].string for i in src.span(src.start(fn), src.end(fn)) if src.toks[i].type == tokenize.NAME}
    return toks | {n.id for n in nodes if isinstance(n, ast.Name)} | {n.arg for n in nodes if isinstance(n, ast.arg)}


def _fn_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """The function's parameters and the nodes of its body, not inside nested scopes (a default, an
    annotation or a decorator is evaluated in the enclosing scope: not walked)."""
    a = fn.args
    yield from [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs]
    yield from [a.kwarg] if a.kwarg else []
    todo: list[ast.AST] = list(fn.body)
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, _SCOPES):
            todo.extend(ast.iter_child_nodes(n))


def rename_intents(src: Source, rng: random.Random) -> list[Intent]:
    """Each function's locals renamed at every occurrence, where the tree's occurrences (parameters,
    names, closures' reads) are exactly the NAME tokens of the function that are not an attribute or a
    keyword argument: `global`, an import, an f-string or `except ... as` makes them differ (skipped)."""
    fns = [n for n in src.nodes if isinstance(n, _FUNCS)]
    locals_ = sorted({a.arg for f in fns for a in ast.walk(f.args) if isinstance(a, ast.arg)} - _TAKEN)
    out = []
    for fn in fns:
        lo, hi = src.start(fn), src.end(fn)
        own = list(_fn_nodes(fn))
        inner = [m for s in own if isinstance(s, _SCOPES) for m in ast.walk(s)]
        every = own + inner  # the function's own defaults and annotations are left out: kept as they are
        if any(isinstance(n, ast.Name) and n.id in _DYNAMIC for n in every):
            continue
        shadowed = {m.arg for m in inner if isinstance(m, ast.arg)}
        shadowed |= {m.id for m in inner if isinstance(m, ast.Name) and not isinstance(m.ctx, ast.Load)}
        shadowed |= {m.id for s in own if isinstance(s, ast.ClassDef) for m in ast.walk(s) if isinstance(m, ast.Name)}
        occ: dict[str, list[int]] = {}  # a list: two nodes at one place (an f-string's) must not look like one
        binds: dict[str, set[int]] = {}
        for k, n in enumerate(every):
            name = n.arg if isinstance(n, ast.arg) else n.id if isinstance(n, ast.Name) else None
            if name is not None:
                occ.setdefault(name, []).append(src.start(n))
                if k < len(own) and (isinstance(n, ast.arg) or not isinstance(n.ctx, ast.Load)):  # type: ignore[attr-defined]
                    binds.setdefault(name, set()).add(src.start(n))
        kw = {src.start(k) for k in every if isinstance(k, ast.keyword) and k.arg}
        toks: dict[str, list[int]] = {}
        for i in src.span(lo, hi):
            t = src.toks[i]
            if t.type == tokenize.NAME and src.toks[i - 1].string != "." and t.start not in kw:
                toks.setdefault(t.string, []).append(t.start)
        used = _names_in(src, fn, every)
        for name in sorted(binds, key=lambda n: min(occ[n])):
            sites = sorted(occ[name])
            if name in shadowed or name in _TAKEN or name.startswith("__") or sites != toks.get(name):
                continue
            if sites[0] not in binds[name]:
                continue  # read before it is bound: a global or a closure's name, not this function's
            new = new_name(name, used, locals_, rng)
            if new:
                out.append(Intent("rename", [(o, name, new) for o in sites]))
    return out


# ---------------------------------------------------------------------- add_param


def _insert_at(src: Source, open_i: int) -> tuple[int, bool]:
    """(where an item appended to the bracket at open_i goes, whether it holds items already): after
    its last token, before a trailing comma."""
    j = src.close(open_i) - 1
    if src.toks[j].string == "," and j > open_i:
        j -= 1
    return src.toks[j].end, j > open_i


def add_param_intents(src: Source, rng: random.Random) -> list[Intent]:
    """A parameter appended to each plain module-level def (positional parameters only, no decorator,
    no dunder), passed through by each call below it: positionally where the call passes every
    parameter so, else as `name=name`. A def with a call it cannot extend (a bare generator argument)
    gives none."""
    defs = [n for n in src.tree.body if isinstance(n, _FUNCS)]
    twice = {n for n, c in Counter(d.name for d in defs).items() if c > 1}
    others = sorted({a.arg for d in defs for a in d.args.args} - _TAKEN)
    names_ = {d.name for d in defs}
    calls = sorted(
        ((src.start(c), c) for c in src.nodes if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)),
        key=lambda pc: pc[0],
    )
    calls = [(p, c) for p, c in calls if c.func.id in names_]  # type: ignore[attr-defined]
    out = []
    for fn in defs:
        a = fn.args
        if fn.decorator_list or fn.name in twice or fn.name.startswith("__") or a.posonlyargs or a.vararg:
            continue  # a dunder's signature is Python's; a decorator may call it its own way
        if a.kwonlyargs or a.kwarg:
            continue
        lo, hi = src.start(fn), src.end(fn)
        used = _names_in(src, fn, list(ast.walk(fn)))
        names = [n for n in (*PARAM_NAMES, *others) if _usable(n, "", used)]
        if not names:
            continue
        name = rng.choice(names)
        default = None if not a.defaults and rng.random() < 0.5 else "False" if name in FLAGS else "None"
        param = name if default is None else f"{name}={default}"
        paren = next(i for i in src.span(lo, hi) if src.toks[i].string == "(")
        at, has = _insert_at(src, paren)
        sites = [(at, "", f", {param}" if has else param)]
        before = False
        for pos, c in calls:
            if c.func.id != fn.name:  # type: ignore[attr-defined]
                continue
            if pos < lo:
                before = True
                continue
            i = src.at(pos)
            if i is None or any(isinstance(x, ast.GeneratorExp) for x in c.args) or src.toks[i + 1].string != "(":
                break
            at, has = _insert_at(src, i + 1)
            plain = not c.keywords and not any(isinstance(x, ast.Starred) for x in c.args)
            arg = name if plain and len(c.args) == len(a.args) else f"{name}={name}"
            sites.append((at, "", f", {arg}" if has else arg))
        else:
            if all(x[0] < y[0] for x, y in zip(sites, sites[1:])):
                out.append(Intent("add_param", sites, complete=not before))
    return out


# ---------------------------------------------------------------------- type_hint


def _guess_hint(name: str) -> str | None:
    """A plain hint a parameter's name suggests, or None."""
    if name in FLAGS or name.startswith(("is_", "has_", "use_", "allow_")):
        return "bool"
    ints = {"n", "i", "j", "count", "index", "idx", "size", "length", "depth", "level", "offset", "limit", "lineno"}
    if name in ints or name.startswith(("num_", "n_", "max_", "min_")) or name.endswith(("_count", "_index", "_size")):
        return "int"
    strs = {"name", "text", "path", "prefix", "suffix", "message", "msg", "label", "title", "encoding", "url", "s"}
    if name in strs | {"filename", "line", "mode", "fmt", "pattern", "sep"} or name.endswith(
        ("_name", "_path", "_msg")
    ):
        return "str"
    return "float" if name in {"timeout", "delay", "interval", "ratio", "scale", "factor", "threshold"} else None


def type_hint_intents(src: Source, rng: random.Random) -> list[Intent]:
    """In each class, a parameter name two or more methods leave unannotated, hinted in each of them
    (`x` -> `x: T`, `x=1` -> `x: T = 1`, `x=None` -> `x: T | None = None`); T is the hint the file
    gives that name most often (one line), else one its name suggests (else none)."""
    seen: Counter[tuple[str, str]] = Counter()
    for a in src.nodes:
        if isinstance(a, ast.arg) and a.annotation is not None:
            seg = ast.get_source_segment(src.text, a.annotation) or ""
            if seg and "\n" not in seg and len(seg) <= 40:
                seen[(a.arg, seg)] += 1
    hints: dict[str, str] = {}
    for (name, seg), _ in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0])):
        hints.setdefault(name, seg)
    out = []
    for cls in (n for n in src.nodes if isinstance(n, ast.ClassDef)):
        uses: dict[str, list[tuple[ast.arg, ast.expr | None]]] = {}
        for m in (m for m in cls.body if isinstance(m, _FUNCS)):
            a = m.args
            pos = [*a.posonlyargs, *a.args]
            defaults: list[ast.expr | None] = [None] * (len(pos) - len(a.defaults))
            defaults += a.defaults
            pairs = [*zip(pos, defaults), *zip(a.kwonlyargs, a.kw_defaults)]
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in m.decorator_list)
            for k, (arg, d) in enumerate(pairs):
                if arg.annotation is None and (k or static) and arg.arg not in _TAKEN:
                    uses.setdefault(arg.arg, []).append((arg, d))
        for name, args in sorted(uses.items()):
            hint = hints.get(name) or _guess_hint(name)
            if len(args) < 2 or not hint:
                continue
            sites = []
            for arg, d in args:
                q = src.start(arg) + len(name)
                if d is None:
                    sites.append((q, "", f": {hint}"))
                    continue
                i = src.at(q - len(name))
                if i is None or src.toks[i + 1].string != "=":
                    break
                none = isinstance(d, ast.Constant) and d.value is None and "None" not in hint and "Optional" not in hint
                sites.append(
                    (q, src.text[q : src.toks[i + 2].start], f": {hint} | None = " if none else f": {hint} = ")
                )
            else:
                out.append(Intent("type_hint", sites))
    return out


# ---------------------------------------------------------------------- quote_style and typing_builtin


def quote_style_intents(src: Source, rng: random.Random) -> list[Intent]:
    """Runs of simple literals switched 'x' -> "x" (black's way), or "x" -> 'x' where ' is the file's
    majority; simple: one line, not triple-quoted, no quote or backslash inside."""
    lits = []
    for t in src.toks:
        m = re.fullmatch(r"([A-Za-z]{0,2})(['\"])(.*)\2", t.string, re.S) if t.type == tokenize.STRING else None
        if m and not t.string[len(m[1]) :].startswith(("'''", '"""')) and not re.search(r"['\"\\\n]", m[3]):
            o = "'" if m[2] == '"' else '"'
            lits.append((m[2], (t.start, t.string, f"{m[1]}{o}{m[3]}{o}")))
    count = Counter(q for q, _ in lits)
    switch = {"'"} | ({'"'} if count['"'] < count["'"] else set())
    return [Intent("quote_style", r) for q in sorted(switch) for r in runs(src.text, [s for p, s in lits if p == q])]


def typing_builtin_intents(src: Source, rng: random.Random) -> list[Intent]:
    """Runs of one typing alias imported from `typing` (bare, or `typing.X` after `import typing`)
    rewritten: X[ -> x[, Optional[T] -> T | None (T one line, no string in it, between tokens that
    bind less tightly than `|`)."""
    bare, dotted = set(), False
    for n in src.nodes:
        if isinstance(n, ast.ImportFrom) and n.module == "typing":
            bare |= {a.name for a in n.names if a.asname is None}
        elif isinstance(n, ast.Import):
            dotted |= any(a.name == "typing" and a.asname is None for a in n.names)
    toks, text = src.toks, src.text
    sites: dict[str, list[Edit]] = {}
    for i, t in enumerate(toks[1:-1], 1):
        if t.type != tokenize.NAME or t.string not in {*ALIASES, "Optional"} or toks[i + 1].string != "[":
            continue
        if toks[i - 1].string == ".":
            if not (dotted and i >= 2 and toks[i - 2].string == "typing" and (i < 3 or toks[i - 3].string != ".")):
                continue
            first = i - 2
        elif t.string in bare:
            first = i
        else:
            continue
        if t.string != "Optional":
            sites.setdefault(t.string, []).append(
                (toks[first].start, text[toks[first].start : t.end], ALIASES[t.string])
            )
            continue
        j = src.close(i + 1)
        inner = toks[i + 2 : j]
        depth, top_comma = 0, False
        for u in inner:
            depth += (u.string in "([{") - (u.string in ")]}") if u.type == tokenize.OP else 0
            top_comma |= u.string == "," and depth == 0
        after = toks[j + 1] if j + 1 < len(toks) else None
        if (
            not inner
            or top_comma
            or any(u.type == tokenize.STRING for u in inner)
            or "\n" in text[inner[0].start : inner[-1].end]
            or toks[first - 1].string not in {"(", "[", ",", ":", "->", "=", "|"}
            or not (after is None or after.type == tokenize.NEWLINE or after.string in {")", "]", ",", "=", ":", "|"})
        ):
            continue
        new = text[inner[0].start : inner[-1].end] + " | None"
        sites.setdefault("Optional", []).append((toks[first].start, text[toks[first].start : toks[j].end], new))
    out = []
    for _, ss in sorted(sites.items()):
        flat: list[Edit] = []
        for s in ss:  # an Optional inside another is left to the outer one
            if not flat or s[0] >= flat[-1][0] + len(flat[-1][1]):
                flat.append(s)
        out += [Intent("typing_builtin", r) for r in runs(text, flat)]
    return out


INTENTS: dict[str, Callable[[Source, random.Random], list[Intent]]] = {
    "rename": rename_intents,
    "add_param": add_param_intents,
    "type_hint": type_hint_intents,
    "quote_style": quote_style_intents,
    "typing_builtin": typing_builtin_intents,
}
