"""The package layout: no import cycle between modules, and no folder of more than 15 modules.

The import graph is read from the source with `ast`; nothing is imported. A module's *module-level*
imports are those that run when it is imported: statements at its top level, including under a
top-level `if`, `try` or `with` and in class bodies, but not inside functions and not under
`if TYPE_CHECKING:`. `from x import y` is an edge to `x.y` where that is a module, else to `x`;
relative imports are resolved against the importing module's package. Imports of anything outside
PACKAGES (torch, the standard library, tests, bench) are not edges.

A *deferred* cycle is one that closes only through an import inside a function: it works, but the
two modules still depend on each other, so the only ones allowed are DEFERRED_CYCLES: factories
that import the class they return on demand.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "engine", "launch", "pipeline", "sim", "spot")
MAX_MODULES = 15
# Folders not split into packages yet, at their size when this test was written: they may shrink, not grow.
UNSPLIT = {"engine": 22, "engine/spec": 20}
DEFERRED_CYCLES = {
    # pipeline.actors.actor_class imports the backend it names; precision asks it for a backend's CAPS
    frozenset({"pipeline.actors", "pipeline.actors.attention", "pipeline.actors.deepspeed_actor",
               "pipeline.actors.forward", "pipeline.actors.megatron_actor", "pipeline.actors.precision",
               "pipeline.actors.torch_actor"}),
    # EagleModel.load builds the eagle3_vllm network, a subclass of EagleModel, for that kind
    frozenset({"engine.spec.eagle", "engine.spec.eagle3_vllm"}),
}


def find_modules(root: Path, packages: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module under `packages`."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt]):
    """The import statements that run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _type_checking(node):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _module_level(node.body)


def _all_but_type_checking(tree: ast.Module):
    """Every import statement, inside functions too, except those under `if TYPE_CHECKING:`."""
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node)
               for stmt in node.body for n in ast.walk(stmt)}
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped)


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: dict) -> set[str]:
    def known_prefix(dotted: str) -> str | None:
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                return ".".join(parts[:i])
        return None

    if isinstance(node, ast.Import):
        return {t for a in node.names if (t := known_prefix(a.name))}
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = package[:len(package) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    targets = set()
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in known:
            targets.add(submodule)
        elif (t := known_prefix(source)) is not None:
            targets.add(t)
    return targets


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES, deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports at module level (with `deferred`, inside functions too)."""
    known = find_modules(root, packages)
    graph = {}
    for name, (path, is_package) in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        statements = _all_but_type_checking(tree) if deferred else _module_level(tree.body)
        graph[name] = set().union(*(_targets(s, name, is_package, known) for s in statements)) - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path that ends where it starts."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def describe(graph: dict[str, set[str]], components: list[set[str]]) -> str:
    return "\n".join(" -> ".join(one_cycle(graph, c)) + f" ({len(c)} modules in the cycle's component)"
                     for c in components)


def module_counts(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, int]:
    """Folder -> its .py files other than __init__.py, for every folder under `packages` that has any."""
    counts = {}
    for package in packages:
        for folder in sorted(p for p in [root / package, *(root / package).rglob("*")] if p.is_dir()):
            n = sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")
            if n:
                counts[folder.relative_to(root).as_posix()] = n
    return counts


def test_no_module_level_import_cycle():
    graph = import_graph()
    assert len(graph) > 200, "the walk found too few modules: is PACKAGES right?"
    components = strongly_connected(graph)
    assert not components, "module-level import cycles:\n" + describe(graph, components)


def test_no_cycle_closed_by_a_deferred_import_but_the_known_factories():
    graph = import_graph(deferred=True)
    components = strongly_connected(graph)
    unexpected = [c for c in components if not any(c <= allowed for allowed in DEFERRED_CYCLES)]
    assert not unexpected, "cycles through imports inside functions:\n" + describe(graph, unexpected)


def test_no_folder_holds_more_than_15_modules():
    counts = module_counts()
    over = {f: n for f, n in counts.items() if n > UNSPLIT.get(f, MAX_MODULES)}
    assert not over, f"folders over {MAX_MODULES} modules (group them into packages by stage): {over}"
    split = {f: counts.get(f, 0) for f in UNSPLIT if counts.get(f, 0) <= MAX_MODULES}
    assert not split, f"{split} hold {MAX_MODULES} modules or fewer now: remove them from UNSPLIT"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_see_cycles_through_submodules_and_relative_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from .. import a\n",
        "pkg/b.py": "import os\nif os.sep:\n    from .sub.c import x\n",
    })
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    components = strongly_connected(graph)
    assert components == [{"pkg.a", "pkg.b", "pkg.sub.c"}]
    assert describe(graph, components).startswith("pkg.a -> pkg.b -> pkg.sub.c -> pkg.a")


def test_imports_in_functions_and_under_type_checking_are_not_module_level(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import g\n"
                     "def f():\n    from pkg import a\n"),
    })
    assert not strongly_connected(import_graph(tmp_path, ("pkg",)))
    assert strongly_connected(import_graph(tmp_path, ("pkg",), deferred=True)) == [{"pkg.a", "pkg.b"}]


@pytest.mark.parametrize("n, ok", [(MAX_MODULES, True), (MAX_MODULES + 1, False)])
def test_module_counts_leave_out_init(tmp_path, n, ok):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/__main__.py": "", **{f"pkg/m{i}.py": "" for i in range(n - 1)}})
    assert (module_counts(tmp_path, ("pkg",))["pkg"] <= MAX_MODULES) == ok
