"""What every test folder (tests/, plugins/, examples/) shares: the wait for llama.cpp's build.

Tests marked ``llama_cpp`` need what plugins/stagerun-llamacpp/scripts/build.sh compiles: the
llama-cpp-python wheel (the ``llamacpp`` backend, llama.cpp's own kernels as a reference),
``llama-server`` and ``ggml-rpc-server`` (the side-by-side benchmarks). On a clone where it is
not built yet, ``make test`` starts that build in the background at the lowest CPU priority and
runs the suite beside it, with ``STAGERUN_LLAMA_CPP_BUILD`` naming the file the build writes its
exit status to. The marked tests run last, and the first of them waits for that status (with a
line a minute). Without a build under way, a marked test fails at once if the build is missing,
naming the command that makes it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import time

import pytest

ROOT = pathlib.Path(__file__).parent
BIN = ROOT / ".cache" / "llama.cpp" / "bin"
BUILD_STATUS_ENV = "STAGERUN_LLAMA_CPP_BUILD"
# The build takes about 7 minutes on 2 idle cores; beside a test suite, at the lowest priority,
# what is left of it when the marked tests start.
BUILD_WAIT_S = 45 * 60
NOTE_EVERY_S = 60

_problem: str | None = None  # None: not looked at yet; "": built; else what is wrong


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The marked tests last (the sort is stable: each group keeps its order)."""
    items.sort(key=lambda item: item.get_closest_marker("llama_cpp") is not None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("llama_cpp") is None:
        return
    global _problem
    if _problem is None:
        _problem = _wait_for_build(item.config)
    if _problem:
        pytest.fail(_problem, pytrace=False)


def _wait_for_build(config: pytest.Config) -> str:
    """'' once llama.cpp's build is there (after waiting for one under way), else why not."""
    status_file = os.environ.get(BUILD_STATUS_ENV)
    log = ""
    if status_file:
        status_path = pathlib.Path(status_file)
        log = f"; its log: {status_path.with_suffix('.log')}"
        started = time.monotonic()
        next_note = started
        while not status_path.exists():
            now = time.monotonic()
            if now - started > BUILD_WAIT_S:
                return f"llama.cpp's build did not end in {BUILD_WAIT_S} s{log}"
            if now >= next_note:
                _note(config, f"waiting for llama.cpp's build ({now - started:.0f} s){log}")
                next_note += NOTE_EVERY_S
            time.sleep(1)
        status = status_path.read_text().strip()
        if status != "0":
            return f"llama.cpp's build failed (exit status {status}){log}"
    importlib.invalidate_caches()  # the build may have installed llama_cpp since the start
    missing = [str(BIN / name) for name in ("llama-server", "ggml-rpc-server")]
    missing = [path for path in missing if not os.access(path, os.X_OK)]
    if importlib.util.find_spec("llama_cpp") is None:
        missing.append("the llama_cpp module (llama-cpp-python)")
    if missing:
        return (
            f"llama.cpp is not built: no {', '.join(missing)}; `make install` builds it "
            f"(plugins/stagerun-llamacpp/scripts/build.sh){log}"
        )
    return ""


def _note(config: pytest.Config, line: str) -> None:
    """One line on the terminal, past pytest's output capture."""
    capture = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if capture is None or reporter is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)
