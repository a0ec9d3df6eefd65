"""gradshare's import graph has no cycle between modules, counting every import statement: at module
level, inside functions (the lazy ones) and under TYPE_CHECKING. The packages' layers are checked by the
import contracts (.ci/contracts, pyproject.toml's [tool.importlinter]); this is the module-level rule.

One kind of import is not an edge: a bare ``import gradshare`` inside the package names the package
root, which Python has run before any module of it, and orders nothing (the worker reads
``gradshare.__file__``). ``from gradshare import X`` is an edge to the root, like any other."""

from __future__ import annotations

import ast
from pathlib import Path

import gradshare

PACKAGE = Path(gradshare.__file__).parent

# Type-only back-references from a protocol core's helper modules to the core they take as an argument
# (`core: PeerCore`): the helpers are parts of the core's class, split out to keep modules small. Listed
# whole, so that a new cycle of any kind fails; the way out is a Protocol of what each helper uses.
TYPE_ONLY_BACK_REFERENCES = {
    ("gradshare.transport.protocol.peer_inbound", "gradshare.transport.protocol.peer_core"),
    ("gradshare.transport.protocol.peer_snapshot", "gradshare.transport.protocol.peer_core"),
    ("gradshare.transport.protocol.relay_attempt", "gradshare.transport.protocol.relay_core"),
    ("gradshare.transport.protocol.relay_liveness", "gradshare.transport.protocol.relay_core"),
    ("gradshare.transport.protocol.relay_log", "gradshare.transport.protocol.relay_core"),
}


def modules(package: Path = PACKAGE, name: str = "gradshare") -> dict[str, Path]:
    mods = {}
    for path in package.rglob("*.py"):
        parts = (name, *path.relative_to(package).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module `name` is, or the one it names an attribute of (gradshare.x.y.Z -> gradshare.x.y)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name not in package.split(".")[:1]]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[m] |= {t for t in (_resolve(t, mods) for t in targets) if t is not None and t != m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path (its first module repeated at the end), or None."""
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for t in sorted(graph[m]):
            if (cycle := visit(t, path + [m])) is not None:
                return cycle
        done.add(m)
        return None

    for m in sorted(graph):
        if (cycle := visit(m, [])) is not None:
            return cycle
    return None


def test_gradshare_has_no_import_cycle():
    graph = import_graph(modules())
    for source, target in TYPE_ONLY_BACK_REFERENCES:
        assert target in graph[source], f"{source} no longer imports {target}: drop it from the list"
        graph[source].discard(target)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_lazy_type_checking_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import pkg\n")  # a bare import of the root: no edge
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n")
    (pkg / "c.py").write_text("from pkg.a import f\n")
    graph = import_graph(modules(pkg, "pkg"))
    assert graph["pkg"] == set()
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
