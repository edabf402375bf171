"""Layer 0 (static, no import): the package layers hold, no modules import in a circle, and
the tools reach the runtime through its packages' front doors only.

Every module under dbo/, moe/, streams/, traces/ is parsed with `ast`; every import in it
counts, at module level or inside a function (a lazy import is still an arrow) and under
`if TYPE_CHECKING:` too (there are none today; exempting them would hide a dependency
that a reader still has to follow). Importing `a.b.c` also runs the packages `a` and
`a.b`, so those count as imported for the layer check.

The layers, lowest first (a module may import its own layer and those below):

    0  streams
    1  dbo: the runtime core (with its phase ranges, dbo.ranges)
    2  kernels: moe.kernels (fused MoE, rows, routing), moe.backends.kernels (the
       backends' slot and send-order kernels), moe.models.rotary*, and the two modules
       they build on, moe.workspace and moe.row_layout: what a kernel needs of the MoE
       runtime (a config's fields, an expert form) comes as arguments
    3  moe: the MoE runtime
    4  models: moe.models (reference transformer, presets), moe.hf (Hugging Face adapters)
    5  tools: dbo.cli (the `dbo` command and its jobs, bench, soak), moe.bench (expert
       benches and tuners), traces (readers, analyzer, timelines, capture)

The front door: a tool module imports a runtime module only if it is a package (`dbo`,
`dbo.split`, `moe`, `moe.backends`, `moe.backends.kernels`, `moe.experts`, `moe.kernels`,
`moe.kernels.fused_moe`, `moe.hf`, `moe.models`, `streams`), and from it only the names
its `__init__.py` lists in `__all__`: `from moe.backends import check_ll_shape`, never
`from moe.backends.deepep_support import check_ll_shape`. The tests themselves are exempt
(they are not under the four packages).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("streams", "traces", "dbo", "moe")

LAYER_NAMES = ("streams", "dbo runtime core", "kernels", "moe runtime", "models", "tools")
TOOLS = LAYER_NAMES.index("tools")

# Longest matching prefix wins (`mod == prefix` or `mod` starts with `prefix + "."`).
PREFIX_LAYERS = {
    "streams": 0,
    "traces": 5,
    "dbo": 1,
    "dbo.cli": 5,
    "moe": 3,
    "moe.kernels": 2,
    "moe.backends.kernels": 2,
    "moe.models.rotary": 2,
    "moe.models.rotary_triton": 2,
    "moe.workspace": 2,
    "moe.row_layout": 2,
    "moe.models": 4,
    "moe.hf": 4,
    "moe.bench": 5,
}


def layer_of(module: str) -> int:
    """The layer (index into LAYER_NAMES) of a dotted module name."""
    matches = [p for p in PREFIX_LAYERS if module == p or module.startswith(p + ".")]
    assert matches, f"{module} is in no layer: add its package to PREFIX_LAYERS"
    return PREFIX_LAYERS[max(matches, key=len)]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the four packages: dotted name -> file (`pkg/__init__.py` is `pkg`)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def from_target(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name a `from ... import` in `module` (file `path`) reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `module` imports anywhere in its file (ours only, resolved:
    `from a import b` is `a.b` when that is a module, else `a`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = from_target(module, path, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports directly (each resolved to a module file)."""
    files = module_files(root)
    known = set(files)
    graph = {}
    for module, path in files.items():
        targets = set()
        for name in imports_of(module, path, known):
            while name not in known and "." in name:  # `import a.b.attr` style: the module
                name = name.rsplit(".", 1)[0]
            if name in known and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def parents(module: str) -> list[str]:
    """The packages that importing `module` runs first: `a.b.c` -> [`a`, `a.b`]."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that runs from a lower layer to a higher one."""
    problems = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            # The target itself, else the first package above it that runs up.
            for imported in [target, *parents(target)]:
                if imported in parents(module) or layer_of(imported) <= layer_of(module):
                    continue
                via = "" if imported == target else f" (run by importing {target})"
                problems.append(
                    f"{module} [{LAYER_NAMES[layer_of(module)]}] imports {imported}"
                    f"{via} [{LAYER_NAMES[layer_of(imported)]}]")
                break
    return problems


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted.
    A package's `__init__` importing its own children is no circle (Python runs the
    package first), so edges from a module to its own parent packages are left out."""
    edges = {m: {t for t in ts if t not in parents(m)} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def declared_all(path: Path) -> Optional[list[str]]:
    """The names a package's `__init__.py` lists in `__all__` (a literal list or tuple of
    strings, annotated or not), or None where it assigns none."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) and node.value
                   else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, (list, tuple)), f"{path}: __all__ is not a literal list"
            return list(value)
    return None


def runtime_packages(root: Path = ROOT) -> dict[str, Path]:
    """The runtime's packages (every package below the tools): name -> its `__init__.py`."""
    return {m: p for m, p in module_files(root).items()
            if p.name == "__init__.py" and layer_of(m) < TOOLS}


def front_door(module: str, packages: dict[str, Path]) -> str:
    """The runtime package a tool imports `module` through: the innermost one holding it."""
    parts = module.split(".")
    while len(parts) > 1 and ".".join(parts) not in packages:
        parts.pop()
    return ".".join(parts)


def side_doors(root: Path = ROOT) -> list[str]:
    """One line per import in a tool module that reaches the runtime other than through a
    package's `__all__`: a runtime module that is not a package, or a name the package
    does not list."""
    packages = runtime_packages(root)
    exported = {name: declared_all(path) or [] for name, path in packages.items()}
    problems = []
    for module, path in sorted(module_files(root).items()):
        if layer_of(module) != TOOLS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            where = f"{module}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name
                    if (name.split(".")[0] in PACKAGES and layer_of(name) < TOOLS
                            and name not in packages):
                        door = front_door(name, packages)
                        problems.append(
                            f"{where}: `import {name}` imports a runtime module that is not a "
                            f"package: import what it needs from {door} (`from {door} import "
                            f"...`, names listed in {door}.__all__)")
            elif isinstance(node, ast.ImportFrom):
                target = from_target(module, path, node)
                if target.split(".")[0] not in PACKAGES or layer_of(target) == TOOLS:
                    continue
                names = [alias.name for alias in node.names]
                line = f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"
                if target not in packages:
                    door = front_door(target, packages)
                    problems.append(
                        f"{where}: `{line}` imports {target}, a runtime module that is not a "
                        f"package: import from {door} instead (`from {door} import "
                        f"{', '.join(names)}`; add what {door}.__all__ lacks)")
                    continue
                for name in names:
                    if name != "*" and name not in exported[target]:
                        problems.append(
                            f"{where}: `{line}` imports {name}, which {target}.__all__ does not "
                            f"list: re-export it from {target} and add it to {target}.__all__")
    return problems


def test_every_module_has_a_layer():
    for module in module_files():
        layer_of(module)


def test_no_import_runs_up_a_layer():
    problems = upward_arrows(import_graph())
    assert not problems, "imports that run up a layer:\n" + "\n".join(problems)


def test_no_import_circles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_runtime_core_does_not_import_moe():
    graph = import_graph()
    core = [m for m in graph if layer_of(m) == 1]
    assert "dbo.scheduler" in core and "dbo.cli.run_job" not in core
    assert not [(m, t) for m in core for t in graph[m] if t.split(".")[0] == "moe"]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("line", ["import moe", "from moe.layer import MoELayer",
                                  "def later():\n    import moe.layer"])
def test_an_upward_import_is_named(tmp_path: Path, line: str):
    """The checks would fail on a core module that imports moe, even lazily."""
    _write(tmp_path, {"streams/__init__.py": "", "traces/__init__.py": "",
                      "dbo/__init__.py": "", "dbo/scheduler.py": line + "\n",
                      "moe/__init__.py": "", "moe/layer.py": "import dbo.scheduler\n"})
    problems = upward_arrows(import_graph(tmp_path))
    assert problems and problems[0].startswith("dbo.scheduler [dbo runtime core] imports moe")


@pytest.mark.parametrize("module, line", [
    ("moe/kernels/rows.py", "from moe.config import MoEConfig"),
    ("moe/kernels/fused_moe/host.py", "def later():\n    from moe.experts.base import Experts"),
    ("moe/backends/kernels/slots.py", "import moe.layer"),
    ("moe/models/rotary.py", "from moe.config import MoEConfig"),
])
def test_a_kernel_that_imports_the_moe_runtime_is_named(tmp_path: Path, module: str,
                                                        line: str):
    """Kernels take what they need of the MoE runtime as arguments: a kernel module that
    imports it (even lazily) runs up from the kernels' layer."""
    _write(tmp_path, {"streams/__init__.py": "", "traces/__init__.py": "",
                      "dbo/__init__.py": "", "moe/__init__.py": "", "moe/config.py": "",
                      "moe/layer.py": "", "moe/experts/__init__.py": "",
                      "moe/experts/base.py": "", "moe/kernels/__init__.py": "",
                      "moe/kernels/fused_moe/__init__.py": "",
                      "moe/backends/__init__.py": "", "moe/backends/kernels/__init__.py": "",
                      "moe/models/__init__.py": "", "moe/workspace.py": "",
                      module: "from moe.workspace import Workspace\n" + line + "\n"})
    name = module.removesuffix(".py").replace("/", ".")
    problems = upward_arrows(import_graph(tmp_path))
    assert len(problems) == 1 and problems[0].startswith(f"{name} [kernels] imports moe."), \
        problems
    assert "[moe runtime]" in problems[0]


def test_a_package_init_that_imports_tools_is_named(tmp_path: Path):
    """`import dbo.ranges` runs `dbo/__init__.py`: it may not import the command."""
    _write(tmp_path, {"streams/__init__.py": "", "moe/__init__.py": "", "traces/__init__.py": "",
                      "dbo/__init__.py": "from dbo.cli import main\n", "dbo/ranges.py": "",
                      "dbo/cli/__init__.py": "", "dbo/scheduler.py": "import dbo.ranges\n"})
    assert upward_arrows(import_graph(tmp_path)) == [
        "dbo [dbo runtime core] imports dbo.cli [tools]"]


def test_a_package_run_by_an_import_is_named(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch):
    """`import dbo.ranges` also runs `dbo/__init__.py`: were the ranges in layer 0 and the
    streams to import them, the import would run up through the core's package."""
    _write(tmp_path, {"streams/__init__.py": "", "streams/a.py": "import dbo.ranges\n",
                      "moe/__init__.py": "", "traces/__init__.py": "",
                      "dbo/__init__.py": "", "dbo/ranges.py": ""})
    monkeypatch.setitem(PREFIX_LAYERS, "dbo.ranges", 0)
    assert upward_arrows(import_graph(tmp_path)) == [
        "streams.a [streams] imports dbo (run by importing dbo.ranges) [dbo runtime core]"]


def test_a_circle_is_named(tmp_path: Path):
    _write(tmp_path, {"streams/__init__.py": "", "traces/__init__.py": "",
                      "moe/__init__.py": "", "dbo/__init__.py": "from dbo.a import x\n",
                      "dbo/a.py": "from dbo import b\n",
                      "dbo/b.py": "def f():\n    from dbo.c import y\n",
                      "dbo/c.py": "import dbo.a\n"})
    assert import_cycles(import_graph(tmp_path)) == [["dbo.a", "dbo.b", "dbo.c"]]


def test_every_runtime_package_declares_all():
    packages = runtime_packages()
    assert {"dbo", "dbo.split", "moe", "moe.backends", "moe.backends.kernels", "moe.experts",
            "moe.kernels", "moe.kernels.fused_moe", "moe.hf", "moe.models",
            "streams"} <= set(packages)
    missing = [name for name, path in packages.items() if declared_all(path) is None]
    assert not missing, f"runtime packages without __all__: {missing}"


def test_every_exported_name_resolves():
    """Each name in a runtime package's `__all__` is there (lazy ones through the package's
    `__getattr__`), and is not the package's submodule of that name: once a submodule is
    imported, the package's attribute of its name is the module, which hides a lazily
    re-exported function of the same name."""
    problems = []
    for package, path in sorted(runtime_packages().items()):
        pkg = importlib.import_module(package)
        for name in declared_all(path) or []:
            if (path.parent / f"{name}.py").exists() or (path.parent / name).is_dir():
                importlib.import_module(f"{package}.{name}")
            try:
                value = getattr(pkg, name)
            except ModuleNotFoundError as exc:
                if exc.name == "triton":  # a Triton kernel where triton is not installed
                    continue
                raise
            except AttributeError:
                problems.append(f"{package}.__all__ lists {name}, which {package} lacks")
                continue
            if isinstance(value, ModuleType):
                problems.append(f"{package}.{name} is a module: re-export its names instead, "
                                f"or give the name another spelling")
    assert not problems, "\n".join(problems)


def test_tools_use_the_front_doors():
    problems = side_doors()
    assert not problems, ("tool imports of runtime internals:\n" + "\n".join(problems))


_FRONT_DOOR_TREE = {"streams/__init__.py": "", "traces/__init__.py": "", "moe/__init__.py": "",
                    "dbo/__init__.py": "from dbo.config import DBOConfig\n"
                                       "__all__ = ['DBOConfig']\n",
                    "dbo/config.py": "", "dbo/graphs.py": "", "dbo/cli/__init__.py": ""}


@pytest.mark.parametrize("line,expected", [
    ("from dbo.config import DBOConfig",
     "dbo.cli.job:1: `from dbo.config import DBOConfig` imports dbo.config, a runtime module "
     "that is not a package: import from dbo instead (`from dbo import DBOConfig`; add what "
     "dbo.__all__ lacks)"),
    ("def later():\n    import dbo.graphs",
     "dbo.cli.job:2: `import dbo.graphs` imports a runtime module that is not a package: "
     "import what it needs from dbo (`from dbo import ...`, names listed in dbo.__all__)"),
    ("from dbo import capture_graph",
     "dbo.cli.job:1: `from dbo import capture_graph` imports capture_graph, which dbo.__all__ does "
     "not list: re-export it from dbo and add it to dbo.__all__"),
    ("from ..graphs import capture_graph",
     "dbo.cli.job:1: `from ..graphs import capture_graph` imports dbo.graphs, a runtime module "
     "that is not a package: import from dbo instead (`from dbo import capture_graph`; add what "
     "dbo.__all__ lacks)"),
])
def test_a_side_door_is_named(tmp_path: Path, line: str, expected: str):
    """A tool importing a runtime module that is not a package, or a name its package's
    `__all__` does not list, fails naming the module, the import and the package to use."""
    _write(tmp_path, {**_FRONT_DOOR_TREE, "dbo/cli/job.py": line + "\n"})
    assert side_doors(tmp_path) == [expected]


@pytest.mark.parametrize("line", ["from dbo import DBOConfig", "import dbo",
                                  "from dbo.cli import job", "import streams"])
def test_the_front_door_passes(tmp_path: Path, line: str):
    _write(tmp_path, {**_FRONT_DOOR_TREE, "dbo/cli/job.py": line + "\n",
                      "dbo/graphs.py": "from dbo.config import DBOConfig\n"})
    assert side_doors(tmp_path) == []
