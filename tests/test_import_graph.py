"""The project's modules depend on each other in one direction: no module imports one that imports it back."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "train", "openpangu_model")
TOP_MODULES = ("medusa_model", "medusa_compat", "medusa_choices")
# The engine and the heads: what the public API and the command lines are built on, never the reverse.
MODEL_SIDE = ("inference.medusa_heads", "inference.medusa_decoding", "inference.plain_decoding",
              "inference.decoding", "inference.kv_cache", "inference.tree_buffers", "inference.sampling",
              "inference.calibration", "inference.runtime_choice", "medusa_choices")
COMMAND_LINES = ("inference.cli", "inference.medusa_generate", "inference.generate", "inference.benchmark",
                 "inference.convert_medusa", "medusa_model", "medusa_compat")


def project_modules() -> dict[str, Path]:
    modules = {name: ROOT / f"{name}.py" for name in TOP_MODULES}
    for package in PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Every project import, module-level or inside a function."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for child in sorted(graph[node]):
            if state.get(child) == "open":
                found.append(stack[stack.index(child):] + [child])
            elif child not in state:
                visit(child, stack + [child])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_engine_and_heads_never_import_the_public_api_or_a_command_line():
    graph = import_graph()
    reached = {}

    def reach(node):
        if node not in reached:
            reached[node] = set(graph[node])
            for child in graph[node]:
                reached[node] |= reach(child)
        return reached[node]

    for module in MODEL_SIDE:
        assert not reach(module) & set(COMMAND_LINES), module
