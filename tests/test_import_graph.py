"""The package's layering, checked from its imports (every import statement, also those inside
functions): no cycle among the library's modules, no arrow from the library to the experiment
harness, none from the framework-blind core to a binding or to the distributed layer, and no
framework imported by the core except through the array adapter (``deepreduce.backend.arrays``).

Imports by name at run time (``importlib.import_module``, ``__import__``, ``runpy.run_module``:
the registry's built-in component lists, the CLI's command modules, the C++ extension loader) are
resolved too: each must name its module with a string or an f-string whose fields the test can
read (``__name__``, a loop over a module-level tuple of strings such as the registry's
``_BUILTIN_PACKAGES``; any other field stands for any dotted name), and none may reach the
harness. They load lazily, after every module is imported, and the registry is the one place that
names component packages of every layer, so they are not part of the cycle and layer checks.
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepreduce"
HARNESS = ROOT / "experiments"
FRAMEWORKS = ("torch", "tensorflow", "horovod", "keras", "mpi4py")
BINDINGS = ("deepreduce.torch", "deepreduce.tensorflow")
# the layers above the core; everything else in deepreduce/ is the framework-blind core
ABOVE_CORE = BINDINGS + ("deepreduce.collective", "deepreduce.cli", "deepreduce.__main__")
ADAPTER = "deepreduce.backend.arrays"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(tree: pathlib.Path = PACKAGE) -> dict:
    return {module_name(p): p for p in tree.rglob("*.py")}


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


#: Calls that import a module named by a string.
BY_NAME = ("import_module", "__import__", "run_module")
#: What an f-string field the test cannot read may stand for: any dotted name.
ANY_NAME = r"[A-Za-z_][\w.]*"


def harness_modules() -> set:
    return set(modules(HARNESS))


def extension_modules() -> set:
    """The compiled extensions, ``deepreduce._<folder>`` for each csrc folder with a pybind11 module."""
    return {f"deepreduce._{p.parent.name}" for p in (ROOT / "csrc").glob("*/py_module.cpp")}


def loop_strings(tree: ast.Module) -> dict:
    """``name -> strings`` for every ``for name in CONST`` of the module, where ``CONST`` is a
    module-level tuple or list of string literals (the registry's built-in lists)."""
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
            items = node.value.elts
            if items and all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        consts[target.id] = [i.value for i in items]
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Name) \
                and node.iter.id in consts:
            bound.setdefault(node.target.id, []).extend(consts[node.iter.id])
    return bound


def name_pattern(arg: ast.expr, module: str, bound: dict):
    """A regular expression for the module names an import-by-name argument can take, or None
    when it is neither a string nor an f-string."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return re.escape(arg.value)
    if not isinstance(arg, ast.JoinedStr):
        return None
    parts = []
    for value in arg.values:
        if isinstance(value, ast.Constant):
            parts.append(re.escape(value.value))
        elif isinstance(value.value, ast.Name) and value.value.id == "__name__":
            parts.append(re.escape(module))
        elif isinstance(value.value, ast.Name) and value.value.id in bound:
            parts.append("(?:" + "|".join(map(re.escape, bound[value.value.id])) + ")")
        else:
            parts.append(ANY_NAME)
    return "".join(parts)


def imports_by_name(name: str, path: pathlib.Path) -> list:
    """``(line, pattern)`` of every import by name in a module (pattern None: unreadable)."""
    tree = ast.parse(path.read_text())
    bound = loop_strings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func in BY_NAME:
                found.append((node.lineno, name_pattern(node.args[0], name, bound)))
    return found


@pytest.fixture(scope="module")
def by_name():
    """``module -> [(line, pattern, targets)]``: the library's imports by name, with the known modules
    (library, extensions, harness) each pattern matches."""
    known = set(modules()) | extension_modules() | harness_modules()
    result = {}
    for name, path in modules().items():
        sites = []
        for line, pattern in imports_by_name(name, path):
            targets = sorted(m for m in known if pattern is not None and re.fullmatch(pattern, m))
            sites.append((line, pattern, targets))
        if sites:
            result[name] = sites
    return result


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


def test_the_library_never_imports_the_harness(graph, by_name):
    wrong = {m: sorted(t for t in ts if within(t, ("experiments",))) for m, ts in graph.items()}
    for m, sites in by_name.items():
        for line, pattern, targets in sites:
            wrong.setdefault(f"{m}:{line}", []).extend(t for t in targets if within(t, ("experiments",)))
    assert not {m: ts for m, ts in wrong.items() if ts}


def test_no_literal_of_the_library_names_a_harness_module():
    """Nor through a string that another mechanism imports (an entry point value, ``sys.modules``):
    no string literal of the library other than a docstring is a harness module's name."""
    harness = harness_modules()
    wrong = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if node.value.split(":")[0].strip() in harness:
                    wrong.append(f"{name}:{node.lineno}: {node.value!r}")
    assert not wrong


def test_every_import_by_name_is_resolved(by_name):
    """Each names a known module, so the test above sees where it leads: the registry's lists, the
    CLI's command modules and the extension loader all resolve, and a typo in a list fails here."""
    assert {"deepreduce.registry", "deepreduce.cli", "deepreduce.backend._native"} <= set(by_name)
    unreadable = [f"{m}:{line}" for m, sites in by_name.items() for line, pattern, _ in sites if pattern is None]
    assert not unreadable, "write the module name as a string or an f-string: " + ", ".join(unreadable)
    unresolved = [f"{m}:{line} {pattern}" for m, sites in by_name.items() for line, pattern, targets in sites
                  if not targets]
    assert not unresolved
    registry = {t for _, _, targets in by_name["deepreduce.registry"] for t in targets}
    assert {"deepreduce.sparsify.sidco", "deepreduce.collective.comm.horovod", "deepreduce.memory",
            "deepreduce.collective.aggregation"} <= registry
    commands = {m for m in modules() if m.startswith("deepreduce.cli.")}
    assert {t for _, _, targets in by_name["deepreduce.cli"] for t in targets} == commands == {"deepreduce.cli.inspect"}


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


def test_the_backend_imports_no_component_and_no_pipeline(graph):
    """``deepreduce.backend`` (arrays, kernels, the C++ loader and pipeline subset) is the layer the
    components stand on: it names the C++ pipeline's stages by their ids, and the core reads its
    components into the C++ settings (``Pipeline.native_settings``), so no arrow points up."""
    upper = ("deepreduce.index", "deepreduce.values", "deepreduce.sparsify", "deepreduce.memory",
             "deepreduce.memory_compact", "deepreduce.summable", "deepreduce.pipeline", "deepreduce.registry")
    wrong = {m: sorted(t for t in ts if within(t, upper))
             for m, ts in graph.items() if within(m, ("deepreduce.backend",))}
    assert {m for m in graph if within(m, ("deepreduce.backend",))} >= {"deepreduce.backend.native_pipeline"}
    assert not {m: ts for m, ts in wrong.items() if ts}
