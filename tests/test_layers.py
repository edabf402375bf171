"""Layer 0 (static, no import): the package layers hold, and no modules import in a circle.

Every module under dbo/, moe/, streams/, traces/ is parsed with `ast`; every import in it
counts, at module level or inside a function (a lazy import is still an arrow) and under
`if TYPE_CHECKING:` too (there are none today; exempting them would hide a dependency
that a reader still has to follow). Importing `a.b.c` also runs the packages `a` and
`a.b`, so those count as imported for the layer check.

The layers, lowest first (a module may import its own layer and those below):

    0  streams, traces.ranges (the phase ranges) and the `traces` package itself
    1  dbo: the runtime core
    2  kernels: moe.kernels (fused MoE, rows, routing), moe.backends.kernels (the
       backends' slot and send-order kernels), moe.models.rotary*, and the two modules
       they build on, moe.workspace and moe.row_layout: what a kernel needs of the MoE
       runtime (a config's fields, an expert form) comes as arguments
    3  moe: the MoE runtime
    4  models: moe.models (reference transformer, presets), moe.hf (Hugging Face adapters)
    5  tools: dbo.cli (the `dbo` command and its jobs, bench, soak), moe.bench (expert
       benches and tuners), traces.* (readers, analyzer, timelines, capture)
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("streams", "traces", "dbo", "moe")

LAYER_NAMES = ("streams/annotations", "dbo runtime core", "kernels", "moe runtime", "models",
               "tools")

# Longest matching prefix wins (`mod == prefix` or `mod` starts with `prefix + "."`).
PREFIX_LAYERS = {
    "streams": 0,
    "traces": 5,
    "traces.ranges": 0,
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
# Package `__init__` modules whose layer differs from their children's: `traces` only
# re-exports the phase ranges, because importing `traces.ranges` runs it.
EXACT_LAYERS = {"traces": 0}


def layer_of(module: str) -> int:
    """The layer (index into LAYER_NAMES) of a dotted module name."""
    if module in EXACT_LAYERS:
        return EXACT_LAYERS[module]
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


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `module` imports anywhere in its file (ours only, resolved:
    `from a import b` is `a.b` when that is a module, else `a`)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
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
    """`import traces.ranges` runs `traces/__init__.py`: it may not import the analyzer."""
    _write(tmp_path, {"streams/__init__.py": "", "moe/__init__.py": "",
                      "traces/__init__.py": "from traces.analyze import analyze\n",
                      "traces/ranges.py": "", "traces/analyze.py": "",
                      "dbo/__init__.py": "", "dbo/scheduler.py": "import traces.ranges\n"})
    assert upward_arrows(import_graph(tmp_path)) == [
        "traces [streams/annotations] imports traces.analyze [tools]"]


def test_a_package_run_by_an_import_is_named(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch):
    """`import traces.ranges` from the core also runs `traces/__init__.py`: were that
    package a tool, the core's import would run up."""
    _write(tmp_path, {"streams/__init__.py": "", "moe/__init__.py": "",
                      "traces/__init__.py": "", "traces/ranges.py": "",
                      "dbo/__init__.py": "", "dbo/scheduler.py": "import traces.ranges\n"})
    monkeypatch.delitem(EXACT_LAYERS, "traces")
    assert upward_arrows(import_graph(tmp_path)) == [
        "dbo.scheduler [dbo runtime core] imports traces (run by importing traces.ranges) "
        "[tools]"]


def test_a_circle_is_named(tmp_path: Path):
    _write(tmp_path, {"streams/__init__.py": "", "traces/__init__.py": "",
                      "moe/__init__.py": "", "dbo/__init__.py": "from dbo.a import x\n",
                      "dbo/a.py": "from dbo import b\n",
                      "dbo/b.py": "def f():\n    from dbo.c import y\n",
                      "dbo/c.py": "import dbo.a\n"})
    assert import_cycles(import_graph(tmp_path)) == [["dbo.a", "dbo.b", "dbo.c"]]
