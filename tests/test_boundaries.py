"""Every module of the package keeps to what its room may import, and is named in the docs.

Each subpackage of `slidesnake` (a room) lists in its docstring the rooms it may import,
and `MAY_IMPORT` holds those lists; each module at the top has its own: `errors`,
`atomic`, `side_files` and `finite` import nothing of ours but `errors`, and the command
line's `cli`, `doctor` and `bench` what their commands use. Every module of the package
is governed by one list, and docs/layout.md names every module. Function-level imports
count too. `slidesnake/__init__.py` imports only `errors` at once, the rest on first use,
so that the server's environment can import `slidesnake.serve`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "slidesnake"

# room -> the rooms of ours it may import (besides itself)
MAY_IMPORT = {
    "slides": {"errors"},
    "tiling": {"slides", "errors", "atomic", "side_files"},
    "loader": {"slides", "tiling", "errors"},
    "models": {"errors", "atomic", "side_files"},
    "embed": {"loader", "slides", "models", "tiling", "errors", "atomic", "finite"},
    "cohort": {
        "slides",
        "tiling",
        "embed",
        "aggregate",
        "remote",
        "models",
        "errors",
        "atomic",
        "side_files",
    },
    "aggregate": {"embed", "tiling", "models", "errors", "atomic", "finite"},
    "cluster": {"errors"},
    "remote": {"embed", "loader", "models", "tiling", "errors", "atomic"},
    "serve": {"models", "errors"},
    "errors": set(),
    "atomic": set(),
    "side_files": set(),
    "finite": {"errors"},
    "__init__": {"errors"},
    "__main__": {"cli"},
    "bench": {"embed", "loader", "models", "slides", "tiling", "errors"},
    "doctor": {"cohort", "embed", "models", "remote", "slides", "errors"},
    "cli": {"bench", "doctor", "cohort", "embed", "models", "remote", "slides", "tiling", "errors"},
}
# The modules at the top of the package, not rooms of their own.
TOP_MODULES = {p.stem for p in PACKAGE.glob("*.py")}
# room -> third-party modules it must not import (prefixes)
MUST_NOT_IMPORT = {
    "slides": {"torch", "timm"},
    "tiling": {"torch", "timm"},
    "loader": {"torch", "timm"},
    "cohort": {"torch", "timm"},
    "cluster": {"torch", "timm"},
    "remote": {"torch", "timm"},
    "aggregate": {"torch.cuda", "timm"},
    # The server's environment has numpy 1 and none of zarr, OpenSlide, pandas, httpx.
    "serve": {"zarr", "openslide", "pandas", "pyarrow", "httpx", "tifffile"},
}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, at any depth; `torch.cuda` attribute
    uses count as imports of `torch.cuda`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: use absolute imports"
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif _is_torch_cuda(node):
            found.append((node.lineno, "torch.cuda"))
    return found


def _is_torch_cuda(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "cuda"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def room_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def violations(path: Path, room: str) -> list[str]:
    found = []
    for line, module in imports(path):
        parts = module.split(".")
        if parts[0] == "slidesnake":
            target = parts[1] if len(parts) > 1 else "slidesnake"
            if target != room and target not in MAY_IMPORT[room]:
                found.append(f"{path.name}:{line}: {room} imports {module}")
        for banned in MUST_NOT_IMPORT.get(room, ()):
            if module == banned or module.startswith(banned + "."):
                found.append(f"{path.name}:{line}: {room} imports {module}")
    return found


GOVERNED = sorted(p for p in PACKAGE.rglob("*.py") if room_of(p) in MAY_IMPORT)


@pytest.mark.parametrize("path", GOVERNED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_what_its_room_may(path):
    assert violations(path, room_of(path)) == []


def test_every_subpackage_is_governed_and_says_what_it_holds():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(MAY_IMPORT) - TOP_MODULES
    for room in rooms:
        docstring = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text()))
        assert docstring and "import" in docstring.lower(), (
            f"{room}/__init__.py: say what it may import"
        )


def test_every_module_is_governed_and_named_in_the_layout_page():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert modules == GOVERNED
    page = (PACKAGE.parent / "docs" / "layout.md").read_text()
    unnamed = [p.stem for p in modules if p.stem != "__init__" and f"`{p.stem}`" not in page]
    assert unnamed == []


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles() -> list[list[str]]:
    """Cycles among the package's modules, by their imports at any depth."""
    graph: dict[str, set[str]] = {}
    for path in GOVERNED:
        name, targets = module_name(path), set()
        for _, module in imports(path):
            while module and module not in graph.keys() | {module_name(p) for p in GOVERNED}:
                module = module.rpartition(".")[0]  # `from a.b import name` imports a.b
            if module.startswith("slidesnake.") and module != name:
                targets.add(module)
        graph[name] = targets
    cycles, done = [], set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycles.append([*trail[trail.index(node) :], node])
            return
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, [*trail, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return cycles


def test_no_module_imports_one_that_imports_it_back():
    assert import_cycles() == []


def test_the_workflows_own_python_imports_no_torch():
    """What common.smk imports at DAG time: torch there would cost seconds per run."""
    code = (
        "import sys; import slidesnake.cohort.config, slidesnake.cohort.rule_params, "
        "slidesnake.cohort.samples, slidesnake.cohort.summary, slidesnake.cohort.run_checks, "
        "slidesnake.models.registry, "
        "slidesnake.cluster.stuck_jobs; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'timm')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize(
    ("room", "source", "caught"),
    [
        ("models", "def f():\n    from slidesnake.loader.batches import TileBatches\n", "loader"),
        ("slides", "import slidesnake.tiling.grid\n", "slidesnake.tiling.grid"),
        ("loader", "import numpy\nimport torch\n", "torch"),
        ("aggregate", "import torch\nx = torch.cuda.is_available()\n", "torch.cuda"),
        ("cohort", "from torch import nn\n", "torch.nn"),
    ],
)
def test_a_forbidden_import_is_caught(tmp_path, room, source, caught):
    module = tmp_path / "probe.py"
    module.write_text(source)
    found = violations(module, room)
    assert len(found) == 1 and caught in found[0]


# The rules whose jobs run no network: masking, tiling, pooling, the embedding map and the
# cohort's slide list. A torch import costs each such job seconds of start-up per slide.
TORCH_FREE_SCRIPTS = [
    "tissue_mask.py",
    "tile_coords.py",
    "pool_slide.py",
    "draw_embedding_map.py",
    "list_cohort_slides.py",
]


def torch_modules_after_importing(modules: list[str]) -> str:
    """What a fresh interpreter holds of torch and timm after importing `modules`."""
    code = (
        f"import sys; import {', '.join(modules)}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'timm')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def script_imports(script: str) -> list[str]:
    """The modules a rule's script imports at its top, all of them ours."""
    path = PACKAGE.parent / "scripts" / script
    modules = sorted({module.rsplit(".", 1)[0] for _, module in imports(path)})
    assert modules and all(m.startswith("slidesnake") for m in modules), modules
    return modules


@pytest.mark.parametrize("script", TORCH_FREE_SCRIPTS)
def test_a_rule_script_without_a_network_imports_no_torch(script):
    assert torch_modules_after_importing(script_imports(script)) == "[]"


def test_a_remote_backend_job_imports_no_torch():
    """Its model is on the server: what the job's script imports at its top, the job's
    one path and its loop (loader, store), the served run (client, preprocessing) and
    the CLI start without torch's 1.5 s; the job imports a local model's run only for
    a local model."""
    script = PACKAGE.parent / "scripts" / "embed_tiles.py"
    top = [n.module for n in ast.parse(script.read_text()).body if isinstance(n, ast.ImportFrom)]
    modules = [*top, "slidesnake.cohort.rule_jobs", "slidesnake.cohort.job_models"]
    modules += ["slidesnake.embed.job", "slidesnake.remote.served_run", "slidesnake.cli"]
    assert torch_modules_after_importing(modules) == "[]"


@pytest.mark.parametrize("room", ["embed", "remote", "slides"])
def test_a_function_of_the_embedding_rooms_reads_in_one_screen(room):
    """No function of the embedding job's rooms is longer than 50 lines."""
    long = [
        f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted((PACKAGE / room).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 50
    ]
    assert long == []
