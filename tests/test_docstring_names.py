"""Every ``stagerun.*`` name a docstring cites in backticks resolves to something that exists.

Docstrings name modules, classes and methods (`stagerun._driver._prefill`,
`stagerun.testing.check_backend`, `stagerun._stage._server.StageServer.forward`); when code
moves, such a citation goes stale silently. This walks every module of the package with `ast`
(nothing is executed but imports), collects the names, and resolves each one by importing its
longest module prefix and taking the rest as attributes.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import pathlib
import re
from collections.abc import Iterator

import stagerun

PACKAGE = pathlib.Path(stagerun.__file__).parent
# A cross-reference is in single backticks (`stagerun.abc.Transport`, or a role's
# :class:`~stagerun._errors.ProtocolError`). Double backticks are literal text, which is how
# docstrings write what is no Python name: entry-point groups (``stagerun.architectures``) and
# telemetry attribute keys (``stagerun.run_id``).
CITED = re.compile(r"(?<!`)`~?(stagerun(?:\.[A-Za-z_]\w*)+)")

# PENDING: broken citations in modules that are being rewritten, as (module file, name); each
# is to be fixed with its module's rewrite, and its entry dropped then.
PENDING: frozenset[tuple[str, str]] = frozenset()


def _docstrings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, text) of the module's, classes' and functions' docstrings, and of the string
    statements that document an assignment (an attribute's or a constant's docstring)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (doc := ast.get_docstring(node, clean=False)) is not None:
                yield body[0].lineno, doc
            for before, statement in itertools.pairwise(body):
                if (
                    isinstance(before, ast.Assign | ast.AnnAssign)
                    and isinstance(statement, ast.Expr)
                    and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)
                ):
                    yield statement.lineno, statement.value.value


def cited_names() -> Iterator[tuple[str, int, str]]:
    """(module file relative to the package's parent, line, name) for every citation."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, text in _docstrings(tree):
            for match in CITED.finditer(text):
                at = line + text.count("\n", 0, match.start())
                yield str(path.relative_to(PACKAGE.parent)), at, match.group(1)


def resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute path below the longest module prefix."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            target: object = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # no such module: try a shorter prefix
            raise
        for attribute in parts[split:]:
            try:
                target = getattr(target, attribute)
            except AttributeError:
                return False
        return True
    return False


def test_the_walk_finds_citations_and_resolves_known_ones() -> None:
    names = {name for _, _, name in cited_names()}
    assert len(names) > 10
    assert "stagerun.abc.Transport" in names
    assert "stagerun.run_id" not in names  # a literal (a telemetry key), not a citation
    assert resolves("stagerun._driver._prefill")
    assert resolves("stagerun.testing.check_backend")
    assert resolves("stagerun._engine.StageEngine.compute")
    assert not resolves("stagerun._driver._no_such_module")
    assert not resolves("stagerun.testing.check_nothing")
    assert not resolves("stagerun._stage._server.StageServer.no_such_method")


def test_every_cited_stagerun_name_resolves() -> None:
    broken = [
        f"{path}:{line}: `{name}`"
        for path, line, name in cited_names()
        if (path, name) not in PENDING and not resolves(name)
    ]
    assert not broken, "docstrings cite names that do not exist:\n" + "\n".join(broken)
