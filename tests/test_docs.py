"""The docs' snippets work as written: README.md, docs/ and the plugin and example READMEs.

* Every ```python block runs in a fresh interpreter, with two substitutions so that it is
  quick and needs no network: the default model's name becomes the tiny test model's path, and
  the API examples' server URL becomes a `stagerun serve` started here. A block that defines
  pytest tests runs under pytest in a new folder, with the configuration docs/plugins.md tells a
  plugin project to use. A block that cannot run here would be listed in `EXCLUDED`.
* Every ``stagerun`` command in a ```sh or ```console block is parsed by the real command-line
  parser (an option or value it refuses fails the test), except `PLACEHOLDERS` (``...``).
* Every ``stagerun generate`` that needs no other host, server or running stage runs as
  written, on the tiny model.
* Every ``curl`` command runs as written against a `stagerun serve` of a tiny model served
  under the default model's name, and must get an answer (an error only where the docs show
  one).

Not run: the shell commands that start long-running servers, stages on other hosts,
benchmarks, ``make`` and ``pip`` (the newcomer's path, `make run` and `make test`, is what CI
runs); their ``stagerun`` lines are parsed.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import attrs
import pytest

from stagerun._options import build_parser
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
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `stagerun serve` on a tiny model served as ``smollm2``, for the API snippets."""
    folder = tmp_path_factory.mktemp("docs-serve")
    model = write_tiny_model(folder / "smollm2.gguf", n_layers=6)  # served as "smollm2"
    log = (folder / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagerun", "serve", "--port", "0", "--stages", "2",
         "--model", str(model)],
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
        code = code.replace("http://127.0.0.1:8000", url).replace(repr(str(tiny_path)), '"smollm2"')
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


# -- shell snippets ------------------------------------------------------------------------------

SHELL = [s for lang in ("sh", "console") for s in snippets(lang)]
HEREDOC = re.compile(r"<<\s*'?(\w+)'?")


def _closed(line: str) -> bool:
    """Whether every quote opened on ``line`` is closed (a quoted argument may span lines)."""
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return False
    return True


def shell_commands(snippet: Snippet) -> list[tuple[int, str]]:
    """The snippet's commands, one per entry with its line: continuations joined, console
    prompts and heredoc bodies dropped."""
    commands: list[tuple[int, str]] = []
    lines = snippet.code.splitlines()
    i = 0
    while i < len(lines):
        line, start = lines[i], snippet.line + i
        while i + 1 < len(lines) and (line.endswith("\\") or not _closed(line)):
            i += 1
            line = (
                line[:-1] + " " + lines[i].strip()
                if line.endswith("\\")
                else line + "\n" + lines[i]
            )
        i += 1
        heredoc = HEREDOC.search(line)
        if heredoc:  # skip the body, up to the terminator
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        line = line.strip().removeprefix("$ ")
        if line and not line.startswith("#"):
            commands.append((start, line))
    return commands


def stagerun_argv(command: str) -> list[str] | None:
    """The arguments of a ``stagerun`` command line, or None if it runs something else."""
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VARIABLE=value prefixes
        words = words[1:]
    if words and words[-1] == "&":
        words = words[:-1]
    if not words or words[0].rsplit("/", 1)[-1] != "stagerun":
        return None
    return words[1:]


STAGERUN_LINES = [
    (s, line, command)
    for s in SHELL
    for line, command in shell_commands(s)
    if stagerun_argv(command) is not None
]
# (document, line) of a stagerun command not parsed, and why
PLACEHOLDERS: dict[tuple[str, int], str] = {
    ("docs/observability.md", 10): "`...` stands for the other options",
    ("plugins/stagerun-torch/README.md", 19): "`...` stands for the other options",
}


def test_the_shell_snippets_are_found_and_the_placeholders_still_point_at_one() -> None:
    assert len(SHELL) >= 35 and len(STAGERUN_LINES) >= 40 and len(CURLS) >= 10
    assert set(EXPECTED_ERRORS) <= {(s.document, line) for s, line, _ in CURLS}
    places = {(s.document, line) for s, line, _ in STAGERUN_LINES}
    assert set(PLACEHOLDERS) <= places, set(PLACEHOLDERS) - places
    print(f"\n{len(SHELL)} shell snippets: {len(STAGERUN_LINES)} stagerun commands parsed "
          f"({len(PLACEHOLDERS)} placeholders not), {len(GENERATES)} of them run, "
          f"{len(CURLS)} curl commands run")  # fmt: skip


@pytest.mark.parametrize(
    ("snippet", "line", "command"),
    STAGERUN_LINES,
    ids=[f"{s.document}:{line}" for s, line, _ in STAGERUN_LINES],
)
def test_every_documented_stagerun_command_parses(
    snippet: Snippet, line: int, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each stagerun command line in the docs is one the command line accepts as written."""
    if (snippet.document, line) in PLACEHOLDERS:
        return
    argv = stagerun_argv(command)
    assert argv is not None
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        usage = capsys.readouterr().err.strip().splitlines()[-1:]
        pytest.fail(f"{snippet.document}:{line}: `{command}` is refused: {usage} ({exc})")


CURLS = [
    (s, line, command)
    for s in SHELL
    for line, command in shell_commands(s)
    if command.startswith("curl ")
]
EXPECTED_ERRORS = {("docs/api.md", 146)}  # the error envelope's example: a bad request


@pytest.mark.parametrize(
    ("snippet", "line", "command"), CURLS, ids=[f"{s.document}:{line}" for s, line, _ in CURLS]
)
def test_every_documented_curl_gets_its_answer(
    snippet: Snippet, line: int, command: str, server_url: str
) -> None:
    """Run as written against a served model (the tiny one, served as ``smollm2``)."""
    command = command.replace("http://127.0.0.1:8000", "$U")
    result = subprocess.run(
        ["bash", "-c", command], env={**os.environ, "U": server_url},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, (snippet.id, command, result.stderr)
    assert result.stdout.strip(), (snippet.id, command)
    answered_error = '"error"' in result.stdout
    assert answered_error == ((snippet.document, line) in EXPECTED_ERRORS), result.stdout[:500]


def _runs_here(command: str) -> bool:
    """A documented `stagerun generate` that needs no other host, server or running stage."""
    argv = stagerun_argv(command) or []
    return argv[:1] == ["generate"] and "--topology" not in argv and "llama-server" not in argv


GENERATES = [(s, line, c) for s, line, c in STAGERUN_LINES if _runs_here(c)]


@pytest.mark.parametrize(
    ("snippet", "line", "command"),
    GENERATES,
    ids=[f"{s.document}:{line}" for s, line, _ in GENERATES],
)
def test_every_documented_generate_runs(
    snippet: Snippet, line: int, command: str, tiny_path: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Run as written, on the tiny model (Q4_0 where a backend reads Q4 blocks)."""
    model = tiny_path
    if "torch-int4" in command:
        model = write_tiny_model(tmp_path / "tiny-q4.gguf", n_layers=6, weights="Q4_0")
    argv = [*(stagerun_argv(command) or []), "--model", str(model)]
    result = subprocess.run(
        [sys.executable, "-m", "stagerun", *argv],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (snippet.id, line, command, result.stderr[-2000:])
    assert result.stdout.strip(), (snippet.id, line, command)
