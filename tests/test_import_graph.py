"""The package's layering, checked from its imports (every import statement, also those inside
functions): no cycle among the library's modules, no arrow from the library to the experiment
harness, none from the framework-blind core to a binding or to the distributed layer, and no
framework imported by the core except through the array adapter (``deepreduce.backend.arrays``)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepreduce"
FRAMEWORKS = ("torch", "tensorflow", "horovod", "keras", "mpi4py")
BINDINGS = ("deepreduce.torch", "deepreduce.tensorflow")
# the layers above the core; everything else in deepreduce/ is the framework-blind core
ABOVE_CORE = BINDINGS + ("deepreduce.collective", "deepreduce.cli", "deepreduce.__main__")
ADAPTER = "deepreduce.backend.arrays"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: pathlib.Path, known: dict) -> set:
    """Every module ``name`` imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            found.update(subs if len(subs) == len(node.names) else subs + [target])
    return found


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_library_has_no_import_cycle(graph):
    edges = {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_library_never_imports_the_harness(graph):
    wrong = {m: sorted(t for t in ts if within(t, ("experiments",))) for m, ts in graph.items()}
    assert not {m: ts for m, ts in wrong.items() if ts}


def test_the_core_imports_no_binding_no_distributed_layer_and_no_framework(graph):
    core = [m for m in graph if not within(m, ABOVE_CORE)]
    assert "deepreduce.pipeline" in core and "deepreduce.sparsify.sidco" in core
    wrong = {}
    for m in core:
        bad = [t for t in graph[m] if within(t, ABOVE_CORE)]
        if m != ADAPTER:
            bad += [t for t in graph[m] if within(t, FRAMEWORKS)]
        if bad:
            wrong[m] = sorted(bad)
    assert not wrong


def test_the_distributed_layer_imports_no_binding(graph):
    wrong = {m: sorted(t for t in ts if within(t, BINDINGS))
             for m, ts in graph.items() if within(m, ("deepreduce.collective",))}
    assert not {m: ts for m, ts in wrong.items() if ts}
