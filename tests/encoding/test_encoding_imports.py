"""The encoding package's import graph has no cycle, counting every import statement (module level,
inside functions, under TYPE_CHECKING): its layers are kernels, forms/, message, the two backends,
backend.py, then the codec, the rules and the states."""

from __future__ import annotations

import ast
from pathlib import Path

import gradshare.encoding

PACKAGE = Path(gradshare.encoding.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("gradshare", "encoding", *path.relative_to(PACKAGE).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[m] |= {t for t in targets if t in mods and t != m}
    return graph


def test_the_encoding_package_has_no_import_cycle():
    graph = _graph()
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m in done:
            return
        for t in sorted(graph[m]):
            visit(t, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_the_cycle_finder_sees_imports_inside_functions():
    graph = _graph()
    # backend.py imports torch_codec inside a function only (torch is loaded when a tensor asks)
    assert "gradshare.encoding.torch_codec" in graph["gradshare.encoding.backend"]
    assert graph["gradshare.encoding.torch_codec"] <= {"gradshare.encoding.message"}
