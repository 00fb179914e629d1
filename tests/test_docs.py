"""The docs' Python snippets run as written.

Every ```python block in README.md, docs/ and the plugin and example READMEs is collected and
run in a fresh interpreter, with two substitutions so that it is quick and needs no network:
the default model's name becomes the tiny test model's path, and the server URL of the API
examples becomes a `stagerun serve` started here on the tiny model. A snippet that defines
pytest tests is run by pytest in a new folder with the configuration docs/plugins.md tells a
plugin project to use. A snippet that cannot run here is listed in `EXCLUDED` with the reason.

Shell snippets are not run yet (see docs/ for how each was checked by hand).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import attrs
import pytest

from stagerun.testing import write_tiny_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
    *sorted(ROOT.glob("examples/*/README.md")),
]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)

# (document, first line of the snippet's code) -> why it is not run here
EXCLUDED: dict[tuple[str, int], str] = {}


@attrs.frozen
class Snippet:
    document: str
    line: int  # where the code starts (1-based)
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"


def snippets(language: str) -> list[Snippet]:
    found = []
    for path in DOCUMENTS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                line = text.count("\n", 0, match.start(2)) + 1
                document = str(path.relative_to(ROOT))
                found.append(Snippet(document, line, language, match.group(2)))
    return found


PYTHON = snippets("python")


def test_the_snippets_are_found_and_every_exclusion_still_points_at_one() -> None:
    assert len(PYTHON) >= 10
    places = {(s.document, s.line) for s in PYTHON}
    assert set(EXCLUDED) <= places, set(EXCLUDED) - places
    print(f"\n{len(PYTHON)} python snippets: {len(PYTHON) - len(EXCLUDED)} run, "
          f"{len(EXCLUDED)} excluded: {sorted(EXCLUDED.values())}")  # fmt: skip


def pytest_config() -> str:
    """The pytest configuration docs/plugins.md gives a plugin project."""
    toml = [s.code for s in snippets("toml") if s.document == "docs/plugins.md"]
    config = next((c for c in toml if "[tool.pytest.ini_options]" in c), None)
    assert config is not None, "docs/plugins.md shows no pytest configuration for plugins"
    return config


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("docs") / "tiny.gguf", n_layers=6)


@pytest.fixture(scope="module")
def server_url(tiny_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `stagerun serve` on the tiny model, for the snippets that talk to the API."""
    log = (tmp_path_factory.mktemp("docs-serve") / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagerun", "serve", "--port", "0", "--stages", "2",
         "--model", str(tiny_path)],
        stdout=subprocess.PIPE, stderr=log,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "listening on " in line, line
        yield line.split("listening on ", 1)[1].split(" ", 1)[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        assert proc.stdout is not None
        proc.stdout.close()
        log.close()


@pytest.mark.parametrize("snippet", PYTHON, ids=[s.id for s in PYTHON])
def test_python_snippet_runs(
    snippet: Snippet,
    tiny_path: pathlib.Path,
    tmp_path: pathlib.Path,
    request: pytest.FixtureRequest,
) -> None:
    reason = EXCLUDED.get((snippet.document, snippet.line))
    if reason is not None:
        # Not run, but it must still be Python.
        compile(snippet.code, snippet.id, "exec")
        return
    code = snippet.code.replace('"smollm2"', repr(str(tiny_path)))
    if "http://127.0.0.1:8000" in code:
        url = request.getfixturevalue("server_url")
        code = code.replace("http://127.0.0.1:8000", url).replace(repr(str(tiny_path)), '"tiny"')
    if re.search(r"^(async )?def test_", code, re.M):
        (tmp_path / "pyproject.toml").write_text(pytest_config())
        (tmp_path / "test_snippet.py").write_text(code)
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "test_snippet.py",
        ]
    else:
        (tmp_path / "snippet.py").write_text(code)
        command = [sys.executable, "snippet.py"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, textwrap.dedent(f"""
        {snippet.id} failed ({result.returncode}):
        {code}
        --- stdout ---
        {result.stdout[-3000:]}
        --- stderr ---
        {result.stderr[-3000:]}""")
