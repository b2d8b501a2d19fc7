"""The house's one rule on imports (DESIGN.md §2): they flow one way. The package's own
import graph, counting every import statement (module top, inside functions, under
TYPE_CHECKING) and the packages an import loads on the way (importing `a.b.c` runs
`a/b/__init__` first), has no cycle; a cycle says two modules share a concern that belongs
in a third, lower one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ckptforensics"
NAME = PACKAGE.name


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def _imports(mod: str, path: Path, is_pkg: bool, known: set[str]) -> set[str]:
    """The package's modules `mod` imports: `from a.b import c` is a.b.c where that is a
    module, else a.b; relative imports resolved."""

    def owner(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {owner(a.name) for a in node.names if a.name.split(".")[0] == NAME}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != NAME:
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in known else owner(base))
    # Importing a.b.c runs a.b's __init__ first (the root's is lazy and imports nothing).
    out |= {
        ".".join(t.split(".")[:k])
        for t in set(out)
        for k in range(2, t.count(".") + 1)
        if not mod.startswith(".".join(t.split(".")[:k]) + ".")
    }
    return out - {mod, ""}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_package_imports_flow_one_way() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, pkg, set(mods)) & set(mods) for m, (p, pkg) in mods.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
