"""The import graph of server/: no module imports another that (directly or not) imports it back,
counting imports inside functions too; and the API process's modules load without torch (only
the spawned scheduler process needs it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "hybrid_serve"
PACKAGE = "server"


def server_imports(path: Path) -> set[str]:
    """The server modules `path` imports anywhere in its body (`from hybrid_serve.server import x`
    counts as server.x when x is a module)."""
    modules = {p.stem for p in (ROOT / PACKAGE).glob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if len(parts) == 3 and parts[:2] == ["hybrid_serve", PACKAGE] and parts[2] in modules:
                found.add(parts[2])
    return found - {path.stem}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_server_has_no_import_cycle():
    graph = {p.stem: server_imports(p) for p in sorted((ROOT / PACKAGE).glob("*.py"))}
    assert len(graph) > 10 and graph["cli"]  # the parse sees the package's imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in hybrid_serve/server/: " + " -> ".join(cycle)


API_MODULES = [
    "hybrid_serve.server.cli",
    "hybrid_serve.server.args",
    "hybrid_serve.server.launch",
    "hybrid_serve.server.http_server",
    "hybrid_serve.server.openai_api",
    "hybrid_serve.server.native_api",
    "hybrid_serve.server.client",
    "hybrid_serve.server.generation",
]


def test_api_process_imports_no_torch():
    """Everything the API process imports up to building the app, and the configs it parses,
    leave torch unloaded; the scheduler process's entry point is named without importing it. Of
    hybrid_serve/kernels/, only the torch-free weight-format table loads (the config validates
    --quantization with it)."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in API_MODULES)
        + "from hybrid_serve.server.args import build_serve_parser, configs_from_args\n"
        + "flags = ['--max-running-requests', '4', '--dtype', 'float32']\n"
        + "configs = configs_from_args(build_serve_parser().parse_args(flags))\n"
        + "from hybrid_serve.scheduler.process import run_scheduler\n"
        + "heavy = sorted(m for m in ('torch', 'transformers', 'hybrid_serve.models',\n"
        + "                           'hybrid_serve.mem_cache') if m in sys.modules)\n"
        + "heavy += sorted(m for m in sys.modules if m.startswith('hybrid_serve.kernels.')\n"
        + "                and m != 'hybrid_serve.kernels.weight_formats')\n"
        + "print(heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_config_dtype_names_match_the_loader():
    """RunnerConfig validates --dtype against a torch-free copy of the loader's names."""
    from hybrid_serve.models.loader import DTYPES
    from hybrid_serve.scheduler.config import DTYPE_NAMES

    assert DTYPE_NAMES == tuple(DTYPES)
