"""The project's modules depend on each other in one direction, floor by floor.

inference/engine (decoding) <- inference/runtime (devices, loading, calibration, files) <- medusa_model (the
public API) <- the command lines in inference/ and train/. A floor never imports one above it, and no module
imports one that imports it back.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "train", "openpangu_model")
TOP_MODULES = ("medusa_model", "medusa_compat", "medusa_choices")
PUBLIC_API = {"medusa_model", "medusa_compat"}


def project_modules() -> dict[str, Path]:
    modules = {name: ROOT / f"{name}.py" for name in TOP_MODULES}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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


def floor(module: str) -> str:
    """engine, runtime, api, command (inference's scripts and train/), or base (models, trees, packages)."""
    if module.startswith("inference.engine"):
        return "engine"
    if module.startswith("inference.runtime"):
        return "runtime"
    if module in PUBLIC_API:
        return "api"
    if module.startswith("train") or module.count(".") == 1 and module.startswith("inference."):
        return "command"
    return "base"


FORBIDDEN = {"engine": {"runtime", "api", "command"}, "runtime": {"api", "command"}, "api": {"command"},
             "base": {"engine", "runtime", "api", "command"}}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import of a floor above the importer's, and every command line that
    `train/` imports (training builds on the runtime and the engine, never on a script)."""
    found = [(module, child) for module, children in graph.items() for child in sorted(children)
             if floor(child) in FORBIDDEN.get(floor(module), set())]
    found += [(module, child) for module, children in graph.items() if module.startswith("train")
              for child in sorted(children) if child.startswith("inference.") and floor(child) == "command"]
    return sorted(found)


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


def test_no_floor_imports_one_above_it():
    """Nothing in the engine imports the runtime; only command lines and train/ import medusa_model."""
    assert upward_imports(import_graph()) == []


def test_every_kind_of_upward_import_is_found():
    graph = {"inference.engine.a": {"inference.runtime.b"}, "inference.runtime.b": {"medusa_model"},
             "medusa_model": {"inference.cli"}, "medusa_choices": {"inference.engine.a"},
             "train.t": {"inference.benchmark", "inference.runtime.b", "medusa_model"},
             "inference.cli": {"medusa_model", "inference.runtime.b"}, "inference.benchmark": set()}
    assert upward_imports(graph) == [("inference.engine.a", "inference.runtime.b"),
                                     ("inference.runtime.b", "medusa_model"), ("medusa_choices", "inference.engine.a"),
                                     ("medusa_model", "inference.cli"), ("train.t", "inference.benchmark")]


def test_the_floors_hold_the_modules_they_are_for():
    modules = project_modules()
    assert {floor(m) for m in modules if m.startswith("inference.engine.")} == {"engine"}
    assert floor("inference.engine.medusa_decoding") == "engine" and floor("inference.runtime.loading") == "runtime"
    assert floor("inference.medusa_generate") == "command" and floor("train.train_medusa") == "command"
    assert "inference.engine.medusa_decoding" in modules and "inference.runtime.calibration" in modules
