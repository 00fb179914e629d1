"""Sizes in stagerun/: no module over 500 lines, no function over 80 (docs/STYLE: files stay
small, a folder per concern).

A function's lines run from its ``def`` to its last line, docstring included; a module's are
the lines of its file. Nested functions and methods are measured on their own as well as
inside what holds them. Two allow-lists name what may be longer, each entry as
``path`` (a module) or ``path::qualified.name`` (a function).
"""

from __future__ import annotations

import ast
import functools
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stagerun"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

# Declarative tables: long because they list things, not because they do much. Each entry
# says what it lists. Logic never goes here; split it instead.
DECLARATIVE: dict[str, str] = {}


def _functions(
    node: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``node``, by qualified name (``Class.method``, ``outer.inner``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:  # statements and expressions: functions under if, try, with...
            yield from _functions(child, prefix)


def oversized(package: pathlib.Path = PACKAGE) -> dict[str, int]:
    """Each module over `MAX_MODULE_LINES` and function over `MAX_FUNCTION_LINES`, with its
    length in lines."""
    found: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            found[name] = lines
        for qualname, node in _functions(ast.parse(source, filename=name)):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found[f"{name}::{qualname}"] = length
    return found


@functools.cache
def _stagerun_oversized() -> dict[str, int]:
    return oversized()


def test_no_module_or_function_is_oversized() -> None:
    allowed = set(DECLARATIVE)
    over = {name: n for name, n in _stagerun_oversized().items() if name not in allowed}
    assert not over, "\n".join(
        f"{name} has {n} lines, more than "
        f"{MAX_FUNCTION_LINES if '::' in name else MAX_MODULE_LINES}: split it along its "
        "concerns (or, for a declarative table, list it in DECLARATIVE)"
        for name, n in sorted(over.items())
    )


def test_every_allowed_entry_is_still_oversized() -> None:
    stale = sorted(entry for entry in DECLARATIVE if entry not in _stagerun_oversized())
    assert not stale, f"not oversized (any more), remove from DECLARATIVE: {stale}"


def test_functions_are_found_in_classes_nested_and_under_blocks(tmp_path: pathlib.Path) -> None:
    long_body = "".join("    x = 1\n" for _ in range(MAX_FUNCTION_LINES))
    nested = "".join("        x = 1\n" for _ in range(MAX_FUNCTION_LINES))
    package = tmp_path / "stagerun"
    package.mkdir()
    (package / "a.py").write_text(
        f"def short():\n    pass\n\ndef long():\n{long_body}"
        f"class C:\n    def method(self):\n{nested}"
        f"if True:\n    def guarded():\n{nested}"
        f"def outer():\n    def inner():\n{nested}"
    )
    (package / "b.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(package) == {
        "stagerun/a.py::long": MAX_FUNCTION_LINES + 1,
        "stagerun/a.py::C.method": MAX_FUNCTION_LINES + 1,
        "stagerun/a.py::guarded": MAX_FUNCTION_LINES + 1,
        "stagerun/a.py::outer": MAX_FUNCTION_LINES + 2,
        "stagerun/a.py::outer.inner": MAX_FUNCTION_LINES + 1,
        "stagerun/b.py": MAX_MODULE_LINES + 1,
    }
