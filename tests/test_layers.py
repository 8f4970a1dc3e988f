"""The package's import graph is layered: no module imports, even inside a function or by a name in a
string, one that imports it back (directly or through others). A lazy import that closes a cycle is how
a lower layer starts depending on a higher one."""

import ast
from pathlib import Path

import mhf_dist

PACKAGE = Path(mhf_dist.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("mhf_dist")
            ):
                # `from mhf_dist.data import recall` imports the module mhf_dist.data.recall
                for alias in node.names:
                    imported.add(
                        f"{node.module}.{alias.name}"
                        if f"{node.module}.{alias.name}" in modules
                        else node.module
                    )
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith("mhf_dist")}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
                imported.add(node.value)  # a module named in a string: importlib.import_module(NAME)
        graph[name] = {other for other in imported if other in modules and other != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for other in sorted(graph[node]):
            if state.get(other) == "open":
                found.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other, [*path, other])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_import_graph_has_no_cycle_even_through_imports_inside_functions():
    graph = import_graph()
    assert "mhf_dist.config" in graph and "mhf_dist.train.worker" in graph  # the walk found the package
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
