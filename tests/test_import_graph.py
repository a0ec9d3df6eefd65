"""gradshare's import graph has no cycle between modules, counting every import statement: at module
level, inside functions (the lazy ones) and under TYPE_CHECKING, a package's ``__init__`` included.

The graph is grimp's, the one import-linter checks the contracts on (.ci/contracts). Its acyclic_siblings
contract there forbids cycles between the children of each package, but an import of a package's own
``__init__`` from inside it is not between siblings: a cycle through one (``task.train -> gradshare ->
driver.trainer -> ... -> task.train``) passes it. This test is the module-level rule."""

from __future__ import annotations

import grimp


def import_graph(package: str) -> grimp.ImportGraph:
    # exclude_type_checking_imports=False is grimp's default, named: a type-only cycle is a cycle here.
    # No cache folder left behind in the checkout.
    return grimp.build_graph(
        package, include_external_packages=False, exclude_type_checking_imports=False, cache_dir=None
    )


def module_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, in order."""
    succ = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in succ[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = stack[stack.index(m) :]
            del stack[stack.index(m) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in succ:
        if m not in index:
            visit(m)
    return sorted(cycles)


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    """The imports between a cycle's modules, with their lines."""
    lines = []
    for a in cycle:
        for b in cycle:
            for d in graph.get_import_details(importer=a, imported=b):
                lines.append(f"  {a}:{d['line_number']} -> {b}   ({d['line_contents']})")
    return "\n".join(lines)


def test_gradshare_has_no_import_cycle():
    graph = import_graph("gradshare")
    cycles = module_cycles(graph)
    assert not cycles, "import cycles between gradshare's modules:\n" + "\n\n".join(
        f"{', '.join(c)}\n{describe(graph, c)}" for c in cycles
    )


def test_the_graph_sees_lazy_type_checking_relative_and_root_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "cycleprobe"
    (pkg / "sub").mkdir(parents=True)
    # through the package root: a type-only import of a module that imports the root lazily
    (pkg / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cycleprobe.a import f\n"
    )
    (pkg / "a.py").write_text("def f():\n    import cycleprobe\n")
    # between submodules: a relative import one way, a lazy one the other
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..c import C\n")
    (pkg / "c.py").write_text("class C: ...\n\ndef g():\n    from cycleprobe.sub import b\n")
    (pkg / "d.py").write_text("import cycleprobe.c\n")  # into a cycle, not part of it
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = import_graph("cycleprobe")
    assert module_cycles(graph) == [["cycleprobe", "cycleprobe.a"], ["cycleprobe.c", "cycleprobe.sub.b"]]
    assert "cycleprobe.a:2 -> cycleprobe " in describe(graph, ["cycleprobe", "cycleprobe.a"])
