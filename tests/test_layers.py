"""The layering of stagerun/ (docs/architecture.md), checked on the import graph.

Every ``import`` and ``from ... import`` in every module counts, at any depth: inside
functions and under ``if TYPE_CHECKING:`` too (a lazy import hides a cycle, it does not remove
it). ``stagerun/__init__.py`` re-exports the public API and is left out of the graph.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "stagerun"

# Lowest first. A module may import from its own component and from lower layers only.
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"_errors", "_util", "_text", "_blas", "_orphans", "telemetry"}),
    ("wire format", {"_proto"}),
    ("decisions", {"_decide"}),
    ("observations: every span and event", {"_spans"}),
    ("model and plugin registry", {"model", "plugins", "_plugin_checks"}),
    ("both ends of a lane", {"_wire"}),
    ("plugin interfaces", {"abc"}),
    ("built-in plugins", {"transports", "backends", "drafters"}),
    ("stage engine", {"_engine"}),
    ("stage side", {"_stage"}),
    ("stage 0, the driver", {"_driver"}),
    ("launch: stages and the driver put together", {"_launch"}),
    ("HTTP server and plugin testing kit", {"server", "testing"}),
    ("command line", {"_cli", "__main__"}),
]
PURE = {"_proto", "_decide"}  # sans-IO: no Trio, no sockets, no threads, no clock
IMPURE_MODULES = {"trio", "asyncio", "socket", "selectors", "threading", "time", "datetime"}


def module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, package_root: pathlib.Path = PACKAGE) -> set[str]:
    """Every module ``path`` imports, by absolute name (a ``from`` import of a submodule names
    the submodule)."""
    name = module_name(path, package_root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    return {
        name: {m for m in imports(path, package) if m in paths and m not in (name, "stagerun")}
        for name, path in paths.items()
        if name != "stagerun"
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected group of two or more modules, as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def component(module: str) -> str:
    return module.split(".")[1]


def layer_of(module: str) -> int:
    for number, (_, names) in enumerate(LAYERS):
        if component(module) in names:
            return number
    raise AssertionError(f"{module} belongs to no layer: add {component(module)} to LAYERS")


def violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(edges.items()):
        for target in sorted(targets):
            if component(target) != component(module) and layer_of(target) > layer_of(module):
                found.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]}, a higher layer)"
                )
    return found


def test_stagerun_has_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_every_import_goes_down_the_layers() -> None:
    assert violations(graph()) == []


@pytest.mark.parametrize("pure", sorted(PURE))
def test_the_sans_io_packages_import_no_trio_socket_thread_or_clock(pure: str) -> None:
    for path in sorted((PACKAGE / pure).rglob("*.py")):
        bad = {m for m in imports(path) if m.split(".")[0] in IMPURE_MODULES}
        bad |= {m for m in imports(path) if m.startswith("stagerun.telemetry")}  # reads clocks
        assert not bad, f"{module_name(path)} imports {sorted(bad)}"


# Pairs of components that never import one another's way, though the layers would allow it:
# the driver talks to stages over lanes only (their engine it shares is a layer below both),
# and the HTTP server never reaches into the command line.
FORBIDDEN = {("_driver", "_stage"), ("server", "_cli")}


def forbidden_imports(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} imports {target}"
        for module, targets in sorted(edges.items())
        for target in sorted(targets)
        if (component(module), component(target)) in FORBIDDEN
    ]


def test_the_stage_side_never_imports_the_driver_and_the_server_never_the_cli() -> None:
    edges = graph()
    for module, targets in edges.items():
        if component(module) == "_stage":
            assert not {t for t in targets if component(t) in {"_driver", "server", "_cli"}}
    assert forbidden_imports(edges) == []


# -- the checks themselves can fail --------------------------------------------------------------


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    package = root / "stagerun"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: pathlib.Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "_driver/__init__.py": "",
            "_driver/_launch.py": "from ._supervise import StageProcess\n",
            "_driver/_supervise.py": "def f():\n    from ._launch import read_ready_line\n",
        },
    )
    assert cycles(graph(package)) == [["stagerun._driver._launch", "stagerun._driver._supervise"]]


def test_an_import_up_the_layers_is_found(tmp_path: pathlib.Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "_stage/__init__.py": "",
            "_stage/_server.py": "from .._driver._lanes import open_connection\n",
            "_driver/__init__.py": "",
            "_driver/_lanes.py": "",
        },
    )
    assert violations(graph(package)) == [
        "stagerun._stage._server (stage side) imports stagerun._driver._lanes "
        "(stage 0, the driver, a higher layer)"
    ]


def test_an_import_of_the_stage_server_from_the_driver_is_found(tmp_path: pathlib.Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "_stage/__init__.py": "",
            "_stage/_server.py": "",
            "_driver/__init__.py": "",
            "_driver/_pipeline.py": "def f():\n    from .._stage._server import serve_stage\n",
        },
    )
    assert violations(graph(package)) == []  # the layers alone allow it
    assert forbidden_imports(graph(package)) == [
        "stagerun._driver._pipeline imports stagerun._stage._server"
    ]
