"""The package's layout (docs/design.md): no import cycle among gradpress's modules, and the library never
imports the lab (the ``gradpress`` command: ``cli.py``, ``__main__.py``, ``testbed/``, ``bench/``).

The imports are read from the source with :mod:`ast`, those inside functions included (a lazy import is
still a dependency) and those under ``if TYPE_CHECKING:`` left out (they never run)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gradpress"
#: the lab: modules named so, or inside packages named so
LAB = ("gradpress.cli", "gradpress.__main__", "gradpress.testbed", "gradpress.bench")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The gradpress modules that ``module`` imports (``from package import name``: the submodule when
    ``name`` is one, else the package)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # gradpress.x.function -> gradpress.x
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_is_read():
    graph = _graph()
    assert "gradpress.cli" in graph["gradpress.__main__"]  # from gradpress.cli import main
    assert "gradpress.cli" in graph["gradpress.bench"]  # from gradpress import cli
    assert "gradpress.exchange.pipeline" in graph["gradpress.testbed.train"]  # one inside a function
    assert "gradpress.core.compressor" in graph["gradpress.cli"]  # from gradpress.core.compressor import ...
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    graph = _graph()
    cycles = _cycles(graph)
    assert cycles == [], "\n".join(
        f"cycle: {' '.join(component)} ("
        + "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(component)))}" for m in component) + ")"
        for component in cycles)


def test_the_library_never_imports_the_lab():
    graph = _graph()
    library = [module for module in graph if not _in(module, LAB)]
    assert "gradpress.ddp" in library and "gradpress.costmodel.predict" in library
    offending = {module: sorted(target for target in graph[module] if _in(target, LAB)) for module in library}
    assert {module: targets for module, targets in offending.items() if targets} == {}
