#!/usr/bin/env python3
"""Finds import cycles between the modules of each Rust crate in the workspace.

A module is a source file (``a/b.rs`` or ``a/b/mod.rs`` is ``a::b``). Module ``A`` depends
on ``B`` when ``A``'s code names a path under ``B`` (``use crate::b::X``, ``super::b::Y``,
``crate::b::Z`` inline, brace lists expanded). A module's use of its ancestors and of its
descendants is how Rust nests modules and is not an edge; every other edge is, and a
cycle among them (two siblings, or modules of different subtrees, that need each other)
is reported. Unit tests (a file's ``#[cfg(test)]`` tail) are left out. Exit status 1
when a cycle is found: usable in CI.

    python3 scripts/module_cycles.py [crates/offload-core/src ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\])*"')
USE = re.compile(r"\buse\s+([^;]+);")
INLINE = re.compile(r"\b(?:crate|super|self)(?:::\w+)+")


def module_of(src: Path, file: Path) -> tuple[str, ...]:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return tuple(parts)


def expand(tree: str) -> list[str]:
    """``a::{b, c::{d, e}}`` -> ``a::b``, ``a::c::d``, ``a::c::e`` (``x as y`` -> ``x@y``)."""
    tree = re.sub(r"\s+as\s+", "@", tree)
    tree = re.sub(r"\s+", "", tree)
    if "{" not in tree:
        return [tree]
    head, _, rest = tree.partition("{")
    body = rest[: rest.rfind("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    items.append(cur)
    return [p for item in items if item for p in expand(head + item)]


Reexports = dict[tuple[str, ...], dict[str, str]]


def resolve(
    path: str,
    here: tuple[str, ...],
    modules: set[tuple[str, ...]],
    reexports: Reexports,
    depth: int = 0,
) -> tuple[str, ...]:
    """The module that defines what a path names: its longest prefix that is a module,
    followed through that module's ``pub use`` re-exports."""
    parts = path.split("::")
    base: list[str]
    if parts[0] == "crate":
        base, parts = [], parts[1:]
    else:
        base = list(here)
        while parts and parts[0] in ("super", "self"):
            if parts[0] == "super":
                base.pop()
            parts = parts[1:]
    full = tuple(base + parts)
    for n in range(len(full), -1, -1):
        if full[:n] in modules:
            module = full[:n]
            item = full[n] if n < len(full) else None
            target = reexports.get(module, {}).get(item or "")
            if target is not None and depth < 8:
                return resolve(target, module, modules, reexports, depth + 1)
            return module
    return ()


PUB_USE = re.compile(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);")


def reexports_of(text: str) -> dict[str, str]:
    """``pub use a::b::C;`` -> ``{"C": "a::b::C"}`` (``self::`` added to plain paths)."""
    out = {}
    for u in PUB_USE.findall(text):
        for item in expand(u):
            path, _, alias = item.partition("@")
            if not path.startswith(("crate::", "super::", "self::")):
                path = "self::" + path
            out[alias or path.rsplit("::", 1)[-1]] = path
    return out


def edges(src: Path) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    files = {module_of(src, f): f for f in src.rglob("*.rs")}
    modules = set(files)
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in modules}
    # Unit tests (a file's `#[cfg(test)]` tail) are not part of the module graph.
    texts = {
        m: STRING.sub('""', COMMENT.sub("", f.read_text())).split("#[cfg(test)]")[0]
        for m, f in files.items()
    }
    reexports = {m: reexports_of(t) for m, t in texts.items()}
    for here, text in texts.items():
        paths = [p for u in USE.findall(text) for p in expand(u)]
        paths += INLINE.findall(USE.sub("", text))
        for item in paths:
            p = item.partition("@")[0]
            if not p.startswith(("crate::", "super::", "self::")):
                continue
            to = resolve(p, here, modules, reexports)
            related = to[: len(here)] == here or here[: len(to)] == to
            if not related:
                graph[here].add(to)
    return graph


def cycles(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[tuple[str, ...]]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[tuple[str, ...], int] = {}
    low: dict[tuple[str, ...], int] = {}
    stack: list[tuple[str, ...]] = []
    on: set[tuple[str, ...]] = set()
    out: list[list[tuple[str, ...]]] = []

    def visit(v: tuple[str, ...]) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    roots = [Path(a) for a in sys.argv[1:]] or sorted(Path("crates").glob("*/src"))
    found = False
    for src in roots:
        graph = edges(src)
        for comp in cycles(graph):
            found = True
            names = ["::".join(m) or "(crate root)" for m in comp]
            print(f"{src}: cycle among {', '.join(names)}")
            for m in comp:
                into = sorted("::".join(t) for t in graph[m] if t in comp)
                print(f"    {'::'.join(m)} -> {', '.join(into)}")
        if not any(True for _ in cycles(graph)):
            print(f"{src}: no cycle among {len(graph)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
