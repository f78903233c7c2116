"""The runtime's import graph, read with `ast` (nothing is imported): the dependency direction of
ARCHITECTURE.md between the five packages, and no import cycle between modules.

    server -> scheduler -> models -> kernels,   scheduler -> mem_cache,   mem_cache -> kernels
    make_model (the checkpoint writers) -> scheduler, models;   server -> make_model

Every import counts, also one inside a function or under `if TYPE_CHECKING:`: for the package
rules, and between modules, which form no cycle at all (neither through the imports that run
when a module loads nor through a deferred or typing-only one).

The benchmark scripts (benchmarks/) sit on top: no runtime module imports one, and they form no
import cycle among themselves either, nor with the runtime.

The family table (`models.families`) names classes and preset modules by dotted path, imported
by `resolve` where they are used: those string imports keep the direction too (the model and
config classes under models/, which the registry resolves; the preset modules, their dicts and
extras under make_model/, which make_model resolves).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # hybrid_serve/ below it holds the packages
PACKAGES = ("server", "scheduler", "models", "kernels", "mem_cache", "make_model")
# package -> the packages of ours it may import
ALLOWED = {
    "server": {"scheduler", "models", "make_model"},
    "scheduler": {"models", "kernels", "mem_cache"},
    "models": {"kernels", "mem_cache"},
    "mem_cache": {"kernels"},
    "kernels": set(),
    "make_model": {"scheduler", "models", "kernels"},
}


def dotted(path: Path) -> str:
    """`ROOT/hybrid_serve/models/loader.py` -> `hybrid_serve.models.loader` (a package is its
    `__init__.py`)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Dotted name -> file of every runtime module."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / "hybrid_serve" / package).rglob("*.py")):
            found[dotted(path)] = path
    return found


def benchmark_modules() -> dict[str, Path]:
    """Dotted name -> file of every module under benchmarks/ (`benchmarks` itself included)."""
    return {dotted(path): path for path in sorted((ROOT / "benchmarks").rglob("*.py"))}


def imports(path: Path, known: dict[str, Path]) -> dict[str, bool]:
    """The runtime modules `path` imports -> whether some import of it runs at load time (top
    level, not under TYPE_CHECKING). `from a import b` names the module a.b where there is one,
    else a."""
    found: dict[str, bool] = {}

    def visit(node: ast.AST, eager: bool) -> None:
        for child in ast.iter_child_nodes(node):
            now = eager
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                now = False
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                now = False
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{path}:{child.lineno}: relative import"
                base = child.module or ""
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                         for a in child.names]  # fmt: skip
            for name in names:
                while name and name not in known and "." in name:  # import a.b.c of a module a.b
                    name = name.rsplit(".", 1)[0]
                if name in known:
                    found[name] = found.get(name, False) or now
            visit(child, now)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def package(module: str) -> str:
    """`hybrid_serve.models.loader` -> `models`."""
    return module.split(".")[1]


def graph(known: dict[str, Path] | None = None) -> dict[str, dict[str, bool]]:
    """Module -> the modules of `known` (default: the runtime's) it imports -> eagerly or not."""
    known = modules() if known is None else known
    return {m: {d: e for d, e in imports(p, known).items() if d != m} for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
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


def test_cycles_finds_components():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(edges) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_parse_sees_the_imports():
    g = graph()
    assert {f"hybrid_serve.{p}" for p in PACKAGES} <= set(g) and len(g) > 100
    assert g["hybrid_serve.scheduler.graph_runner"]["hybrid_serve.models.cpu_decode"] is True
    assert (
        g["hybrid_serve.scheduler.leak_check"]["hybrid_serve.scheduler.session"] is False
    )  # under TYPE_CHECKING
    assert (
        g["hybrid_serve.kernels.kernel_set"]["hybrid_serve.kernels.cpp_fused"] is False
    )  # inside a function


def test_packages_follow_the_dependency_direction():
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in graph().items()
        for d in deps
        if (a := package(m)) != (b := package(d)) and b not in ALLOWED[a]
    )
    assert bad == [], "\n".join(bad)


def test_no_cycle_between_packages():
    edges = {p: set() for p in PACKAGES}
    for m, deps in graph().items():
        edges[package(m)] |= {package(d) for d in deps} - {package(m)}
    found = [sorted(c) for c in cycles(edges)]
    assert found == [], f"packages importing each other: {found}"


def test_no_cycle_between_modules_at_load_time():
    eager = {m: {d for d, e in deps.items() if e} for m, deps in graph().items()}
    found = [sorted(c) for c in cycles(eager)]
    assert found == [], f"modules importing each other at load time: {found}"


def test_no_cycle_between_modules():
    found = [sorted(c) for c in cycles({m: set(deps) for m, deps in graph().items()})]
    assert found == [], f"modules importing each other (deferred or for typing): {found}"


def test_the_parse_sees_the_benchmarks_imports(tmp_path):
    g = graph(benchmark_modules())
    assert "benchmarks" in g and len(g) > 20
    assert g["benchmarks.fidelity"]["benchmarks.margins"] is True
    assert g["benchmarks.serving"]["benchmarks.gsm8k_data"] is True  # from benchmarks import x
    runtime_like = tmp_path / "runtime_like.py"
    runtime_like.write_text("import benchmarks\n\ndef f():\n    from benchmarks.margins import x\n")
    found = imports(runtime_like, {**modules(), **benchmark_modules()})
    assert found == {"benchmarks": True, "benchmarks.margins": False}


def test_no_cycle_between_benchmark_modules():
    found = [sorted(c) for c in cycles({m: set(d) for m, d in graph(benchmark_modules()).items()})]
    assert found == [], f"benchmark modules importing each other: {found}"


def test_the_runtime_imports_no_benchmark():
    known = {**modules(), **benchmark_modules()}
    bad = sorted(
        f"{m} imports {d}"
        for m, path in modules().items()
        for d in imports(path, known)
        if d.split(".")[0] == "benchmarks"
    )
    assert bad == [], "\n".join(bad)


def test_no_cycle_between_runtime_and_benchmark_modules():
    known = {**modules(), **benchmark_modules()}
    found = [sorted(c) for c in cycles({m: set(d) for m, d in graph(known).items()})]
    assert found == [], f"modules importing each other: {found}"


def test_the_family_tables_dotted_paths_follow_the_direction():
    from hybrid_serve.models.families import FAMILIES, resolve

    known = modules()
    bad = []
    for family in FAMILIES:
        resolved_by = {  # dotted path -> the package whose code resolves it
            family.model_class: "models",
            family.config_class: "models",
            f"{family.preset_module}.complete_config": "make_model",
            **dict.fromkeys(family.presets, "make_model"),
            **({family.preset_extra: "make_model"} if family.preset_extra else {}),
        }
        for path, user in resolved_by.items():
            module = path.rpartition(".")[0]
            assert module in known, f"{family.name}: {path} names no runtime module"
            if package(module) != user:
                bad.append(f"{family.name}: {path} (resolved from {user})")
            resolve(path)  # the attribute exists
    assert bad == [], "\n".join(bad)
