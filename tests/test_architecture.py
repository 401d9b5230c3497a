"""The architecture's rules, each stated as a test that fails when the code breaks it.

1. The planner never imports the policies: a policy is handed to the Planner as an object
   (``make_policy(spec)``), so the planner's machinery does not depend on which policies exist.
2. No import circle between files of the package: each file can be read, imported and tested
   after the files it imports, never "all at once".
3. The engine imports nothing of the rest of specplan (planner, policies, profiler, bench, CLI):
   it is the part others plug into, through the SpecDecider and Proposer protocols.
4. No harness assigns to an engine's attributes: benches, profilers and tests steer an engine
   through its public door (``set_decider``, ``set_proposer``, ``set_max_num_seqs``,
   ``reset_stats``), so the engine's insides can change without breaking them.

The checks read the source with ``ast`` (nothing is imported), and each has a test that plants a
violation in a temporary tree to show the check can fail.
"""
from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """Package name -> its directory, as pyproject.toml maps them (specplan.engine -> engine/)."""
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def project_modules(root: Path = ROOT, packages: dict[str, str] | None = None) -> dict[str, Path]:
    """Every module of the package by dotted name; a package's __init__.py under the package's name."""
    modules = {}
    for package, directory in (packages or package_dirs(root)).items():
        for path in sorted((root / directory).glob("*.py")):  # subpackages have entries of their own
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


@dataclass(frozen=True)
class Import:
    target: str  # dotted module name: a submodule if the name imported is one, else the module it comes from
    line: int
    type_checking: bool  # under `if TYPE_CHECKING:`: a dependency, but never run


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import in a file, at the top or inside functions, resolved to absolute module names.

    ``from X import name`` is an import of X.name when that is a module of ``known`` (``from .
    import cpu_kernels`` imports the submodule, not the package's __init__), else of X itself.
    Importing a.b.c also runs a/__init__ and a/b/__init__ first; those implicit parent imports are
    not counted, or every package whose __init__ re-exports its submodules (the ordinary layout)
    would read as a circle with each of them."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, type_checking) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: drop level - 1 parts from the file's own package
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if sub in known else base, node.lineno, type_checking))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def import_graph(modules: dict[str, Path], runtime_only: bool = True) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line of the first such import}."""
    known = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for imp in imports_of(name, path, known):
            if imp.target in known and imp.target != name and not (runtime_only and imp.type_checking):
                edges.setdefault(imp.target, imp.line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)):
            return cycle
    return None


def within(name: str, package: str) -> bool:
    """Whether module ``name`` is ``package`` or inside it."""
    return name == package or name.startswith(package + ".")


def imports_between(modules: dict[str, Path], importer: str, imported: set[str]) -> list[str]:
    """'file:line imports target' for every import, by a module within the package ``importer``, of
    one of the modules ``imported`` (type-checking imports included: a dependency all the same)."""
    known = set(modules)
    return list(dict.fromkeys(  # once per line and target: `from x import a, b` is one import of x
        f"{_rel(path)}:{imp.line} imports {imp.target}"
        for name, path in modules.items() if within(name, importer)
        for imp in imports_of(name, path, known) if imp.target in imported))


# An engine object, for rule 4: any link of the chain named `engine` (engine.step, x.engine.stats,
# llm.engine...), or the engine's parts that only an engine holds.
ENGINE_LINKS = {"engine", "speculator", "scheduler"}


def _chain(node: ast.expr) -> list[str]:
    """The names along an attribute chain, root first: llm.engine.speculator -> [llm, engine, speculator]
    (through calls and subscripts: engine.scheduler.running[0] -> [engine, scheduler, running])."""
    names = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names[::-1]
        else:
            return names[::-1]


def _writes_into_engine(target: ast.expr) -> bool:
    """Whether assigning to ``target`` changes an engine object: x.attr = or x[i] = with x an engine
    object. (self.engine = ... names a harness's own attribute, and is fine.)"""
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_writes_into_engine(t) for t in target.elts)
    if isinstance(target, ast.Starred):
        return _writes_into_engine(target.value)
    if isinstance(target, (ast.Attribute, ast.Subscript)):
        return bool(ENGINE_LINKS & set(_chain(target.value)))
    return False


def engine_writes(path: Path) -> list[str]:
    """'file:line: source' for each statement of a file that assigns into an engine object,
    including setattr(engine, ...) and monkeypatch.setattr(engine, ...)."""
    source = path.read_text()
    tree = ast.parse(source, str(path))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            bad = any(_writes_into_engine(t) for t in node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            bad = _writes_into_engine(node.target)
        elif isinstance(node, ast.Call) and _chain(node.func)[-1:] == ["setattr"] and node.args:
            bad = not isinstance(node.args[0], ast.Constant) and bool(ENGINE_LINKS & set(_chain(node.args[0])))
        else:
            continue
        if bad:
            hits.append(f"{_rel(path)}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return hits


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# Where harnesses live: everything that is not the engine.
HARNESS_DIRS = ("specplan", "profiler", "planner", "policies", "scripts", "tests")


# ---- the rules, on the repository ----

def test_planner_never_imports_policies():
    modules = project_modules()
    policies = {m for m in modules if within(m, "specplan.policies")}
    bad = imports_between(modules, "specplan.planner", policies)
    assert not bad, "planner/ must not import policies/ (a Policy is passed in):\n" + "\n".join(bad)


def test_no_import_circle():
    modules = project_modules()
    graph = import_graph(modules)  # imports inside functions count; those under TYPE_CHECKING never run
    cycle = find_cycle(graph)
    assert cycle is None, "import circle:\n" + "\n".join(
        f"  {_rel(modules[a])}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_engine_imports_nothing_of_the_rest():
    modules = project_modules()
    # planner, policies, profiler, the bench wing, the CLI, adaptive.py, and whatever comes next
    rest = {m for m in modules if not within(m, "specplan.engine")}
    assert {"specplan.planner.goodput", "specplan.bench.evaluate", "specplan.cli"} <= rest
    bad = imports_between(modules, "specplan.engine", rest)
    assert not bad, "engine/ must stand alone:\n" + "\n".join(bad)


def test_no_harness_assigns_into_an_engine():
    files = sorted(p for d in HARNESS_DIRS for p in (ROOT / d).rglob("*.py"))
    assert any(p.name == "evaluate.py" for p in files)  # the scan reaches the harnesses
    bad = [hit for p in files for hit in engine_writes(p)]
    assert not bad, ("harnesses steer the engine through set_decider / set_proposer / set_max_num_seqs / "
                     "reset_stats, never by assigning to it:\n" + "\n".join(bad))


# ---- each check fails on a planted violation ----

def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    packages = {"specplan": "specplan", "specplan.engine": "engine", "specplan.planner": "planner",
                "specplan.policies": "policies"}
    return project_modules(tmp_path, packages)


def test_a_lazy_planner_import_of_policies_is_caught(tmp_path):
    modules = _tree(tmp_path, {
        "planner/__init__.py": "",
        "planner/a.py": "def f():\n    from ..policies import goodput\n",
        "policies/__init__.py": "",
        "policies/goodput.py": "",
    })
    policies = {"specplan.policies", "specplan.policies.goodput"}
    assert imports_between(modules, "specplan.planner", policies) == [
        f"{tmp_path / 'planner/a.py'}:2 imports specplan.policies.goodput"]


def test_an_import_circle_is_caught(tmp_path):
    modules = _tree(tmp_path, {
        "planner/__init__.py": "from . import a\n",  # the package importing its submodule: no circle
        "planner/a.py": "from .b import thing\n",
        "planner/b.py": "def f():\n    from specplan.planner.a import other\n",  # lazy, still runs
        "planner/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import T\n",
        "planner/d.py": "from .c import U\n",  # c -> d only for type checkers: no circle
    })
    graph = import_graph(modules)
    assert graph["specplan.planner"] == {"specplan.planner.a": 1}
    assert find_cycle(graph) == ["specplan.planner.a", "specplan.planner.b", "specplan.planner.a"]
    del modules["specplan.planner.b"]
    assert find_cycle(import_graph(modules)) is None


def test_an_engine_import_of_the_planner_is_caught(tmp_path):
    modules = _tree(tmp_path, {
        "engine/__init__.py": "",
        "engine/x.py": "import specplan.planner.goodput as g\n",
        "planner/__init__.py": "",
        "planner/goodput.py": "from specplan.engine import x\n",  # the other way is fine
    })
    rest = {"specplan.planner", "specplan.planner.goodput"}
    assert imports_between(modules, "specplan.engine", rest) == [
        f"{tmp_path / 'engine/x.py'}:1 imports specplan.planner.goodput"]


def test_assignments_into_an_engine_are_caught(tmp_path):
    path = tmp_path / "harness.py"
    path.write_text("\n".join([
        "engine.step = lambda: None",                        # 1
        "llm.engine.speculator.decider = d",                 # 2
        "x.engine.scheduler.config.max_num_seqs = 4",        # 3
        "engine.stats.k_histogram[0] += 1",                  # 4
        "monkeypatch.setattr(engine, 'step', f)",            # 5
        "self.engine = engine",                              # fine: the harness's own attribute
        "engine.set_decider(d)",                             # fine: the public door
        "n = engine.scheduler.config.max_num_seqs",          # fine: reading
        "engine_config.k = 2",                               # fine: not an engine
    ]))
    assert [hit.split(":")[1] for hit in engine_writes(path)] == ["1", "2", "3", "4", "5"]
