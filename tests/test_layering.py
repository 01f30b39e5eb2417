"""The package's floors, held: imports point down, files never import each other in a loop, and an import inside a
function is kept for optional heavy dependencies (a short list below, each with its reason).

The floors, bottom to top (README's "Layout" draws the same diagram, held to FLOORS by tests/test_readme.py;
../shared/DESIGN.md says it in words):

    interfaces, config  <  catalog  <  quant  <  kernels, distributed  <  kv  <  layers  <  models  <  calibration
    <  loading  <  worker  <  structured  <  sampling  <  spec_decode  <  engine  <  executor  <  llm, cli_args
    <  serve, plots  <  bench, fleet  <  verdict  <  testing  <  grading, quiz  <  cli
    <  __main__ and the package's face (__init__)

A module may import its own package and any package on a lower floor; two packages on one floor stay independent.
Read from the source with `ast` (nothing is imported); `if TYPE_CHECKING:` blocks count like any other import.
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "minillm"

FLOORS: list[tuple[str, ...]] = [
    ("interfaces", "config"),
    ("catalog",),
    ("quant",),
    ("kernels", "distributed"),
    ("kv",),
    ("layers",),
    ("models",),
    ("calibration",),
    ("loading",),
    ("worker",),
    ("structured",),
    ("sampling",),
    ("spec_decode",),
    ("engine",),
    ("executor",),
    ("llm", "cli_args"),
    ("serve", "plots"),
    ("bench", "fleet"),
    ("verdict",),
    ("testing",),
    ("grading", "quiz"),
    ("cli",),
    ("__main__", "__init__"),
]
FLOOR = {pkg: i for i, names in enumerate(FLOORS) for pkg in names}

# Imports inside a function body that stay: (importing module, imported module) -> why. Everything here loads an
# optional heavy dependency that most runs never need, so importing it at module level would cost every process.
LAZY_ALLOWED: dict[tuple[str, str], str] = {
    ("minillm.layers.linear", "minillm.kernels.triton_qgemm"): "imports triton; only CUDA tensors take this path",
    ("minillm.layers.attention", "minillm.kernels.triton_paged_attention"): "imports triton; only the triton backend",
    ("minillm", "minillm.llm"): "PEP 562 __getattr__: `import minillm` for SamplingParams stays free of torch",
    ("minillm.cli", "importlib"): "each subcommand's module loads on use, so --help and flag checks never import torch",
    ("minillm.grading.handin", "minillm.kernels.triton_paged_attention"):
        "imports triton; only in a learner's kernel that handed in a Triton kernel (its source leaves with it)",
    ("minillm.grading.cli", "minillm.grading.trusted"):
        "the sandboxed grader (every lab's checker, nbgrader) loads when a notebook is graded, not for --help",
}
LAZY_BUDGET = 15


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def package(mod: str) -> str:
    """The floor key of a module: its subpackage, or its own name for a module at the top (`minillm` -> __init__)."""
    parts = mod.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def resolve(importer: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The minillm modules an import statement loads (a name imported from a package counts as its submodule when
    one exists)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = importer.split(".")
            if MODULES[importer].name != "__init__.py":
                base = base[:-1]
            base = base[:len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        names = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
    out = []
    for name in names:
        if name != "minillm" and not name.startswith("minillm."):
            continue
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def names_own_module(call: ast.Call) -> bool:
    """importlib.import_module("minillm...") or import_module(f"minillm.{name}"): an import by another spelling."""
    if not (isinstance(call.func, (ast.Attribute, ast.Name)) and
            getattr(call.func, "attr", getattr(call.func, "id", None)) == "import_module" and call.args):
        return False
    arg = call.args[0]
    first = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
    return isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("minillm")


def scan() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """Every module's minillm imports, and the imports that sit inside a function: (importer, imported, line)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    lazy = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[mod].update(resolve(mod, node))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    lazy += [(mod, t, node.lineno) for t in resolve(mod, node)]
                elif isinstance(node, ast.Call) and names_own_module(node):
                    lazy.append((mod, "importlib", node.lineno))
    for mod in edges:
        edges[mod].discard(mod)
    return edges, lazy


EDGES, LAZY = scan()


def test_every_package_has_a_floor():
    unplaced = sorted({package(m) for m in MODULES} - set(FLOOR))
    assert not unplaced, f"packages with no floor in FLOORS: {unplaced} (place them, and say so in README's layout)"


def test_imports_point_down():
    up = [f"{a} -> {b} ({package(a)} is on floor {FLOOR[package(a)]}, {package(b)} on {FLOOR[package(b)]})"
          for a, targets in EDGES.items() for b in sorted(targets)
          if package(a) != package(b) and FLOOR[package(b)] >= FLOOR[package(a)]]
    assert not up, f"{len(up)} import(s) point up or sideways:\n" + "\n".join(up)


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the groups of modules that reach each other (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = itertools.count()
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = next(counter)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = next(counter)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.append(w)
                        if w == v:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return groups


def test_no_import_cycles():
    cycles = strongly_connected(EDGES)
    assert not cycles, "files that import each other in a loop:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_tarjan_finds_a_planted_cycle():
    """The cycle check can fail: a planted loop (and a self-contained chain) is found, the chain is not."""
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_are_the_allowed_few():
    extra = [f"{a}:{line} imports {b} inside a function" for a, b, line in LAZY if (a, b) not in LAZY_ALLOWED]
    assert not extra, ("own-package imports inside functions (move them to the top; a cycle or an upward import "
                       "behind one is a layering problem to fix, not to hide):\n" + "\n".join(extra))
    assert len(LAZY) <= LAZY_BUDGET, f"{len(LAZY)} lazy own-package imports (budget {LAZY_BUDGET}): {LAZY}"


@pytest.mark.parametrize("pair", sorted(LAZY_ALLOWED))
def test_every_allowed_lazy_import_is_still_used(pair):
    assert any((a, b) == pair for a, b, _ in LAZY), f"{pair} is allowed but no longer imported lazily: drop it"


def test_environment_read_only_in_config():
    """Settings have one home: only config.py reads os.environ / os.getenv (a child process may be handed a copy
    of the environment, which is not a read of a setting)."""
    readers = []
    for mod, path in MODULES.items():
        if mod == "minillm.config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{mod}:{node.lineno}")
    assert not readers, "environment read outside config.py:\n" + "\n".join(readers)


def test_interfaces_table_names_every_protocol():
    """interfaces.py's table (its docstring) lists every Protocol the module declares, and nothing it does not."""
    tree = ast.parse(MODULES["minillm.interfaces"].read_text())
    declared = {n.name for n in tree.body if isinstance(n, ast.ClassDef)
                and any(getattr(b, "id", None) == "Protocol" for b in n.bases)}
    table = ast.get_docstring(tree).split("plugged with", 1)[1].split("\n\n", 1)[0]
    listed = {line.split()[0] for line in table.splitlines() if line.startswith("    ") and line[4] != " "}
    assert declared == listed, f"Protocols not in the table: {declared - listed}; listed but not declared: " \
                               f"{listed - declared}"
