"""The host's cores shared between ggml stages, graph by graph (backends/_ggml/_cores.py).

Each `HostCores` here stands for one stage; two on the same lock file are two stages of one
host (OFD locks exclude each other per open file, so one test process can play both).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from stagerun.backends._ggml import _cores
from stagerun.backends._ggml._cores import HostCores


@pytest.fixture
def path(tmp_path: pathlib.Path) -> str:
    return str(tmp_path / "cores")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The cores' monotonic clock, which the test moves on by hand."""
    now = [100.0]
    monkeypatch.setattr(_cores.time, "monotonic", lambda: now[0])
    return now


def test_a_stage_alone_takes_every_core_it_may_use(path: str) -> None:
    stage = HostCores(4, path)
    assert stage.shared
    with stage.taken(3) as threads:
        assert threads == 3
    with stage.taken(8) as threads:
        assert threads == 4


def test_a_stage_computes_on_one_thread_while_another_computes_and_for_a_while_after(
    path: str, clock: list[float]
) -> None:
    first, second = HostCores(2, path), HostCores(2, path)
    with first.taken(2) as threads:
        assert threads == 2
        with second.taken(2) as threads:
            assert threads == 1  # no core free: one thread, holding none
    with first.taken(1), second.taken(2) as threads:
        assert threads == 1  # one core free, but the host is busy
    with second.taken(2) as threads:
        assert threads == 1  # alone again, but it saw another graph just now
    clock[0] += _cores.SETTLE_S + 0.01
    with second.taken(2) as threads:
        assert threads == 2


def test_the_host_idles_from_its_latest_graph_whichever_stage_ran_it(
    path: str, clock: list[float]
) -> None:
    first, second = HostCores(2, path), HostCores(2, path)
    assert first.idle_for() == second.idle_for() == 100.0  # no graph yet
    with first.taken(2):
        clock[0] += 1.0
    clock[0] += 0.5
    assert first.idle_for() == second.idle_for() == 0.5
    with second.taken(1):
        clock[0] += 0.25
    assert first.idle_for() == second.idle_for() == 0.0
    alone = HostCores(2, path + "-elsewhere")
    clock[0] += 2.0
    assert alone.idle_for() == 103.75 and first.idle_for() == 2.0


def test_a_stage_without_the_file_idles_from_its_own_graphs(
    tmp_path: pathlib.Path, clock: list[float]
) -> None:
    stage = HostCores(2, str(tmp_path / "missing" / "cores"))  # cannot be opened
    assert not stage.shared
    with stage.taken(2) as threads:
        assert threads == 2
    clock[0] += 0.5
    assert stage.idle_for() == 0.5


def test_cores_come_back_when_a_stage_closes_or_dies(path: str) -> None:
    holder = HostCores(2, path)
    with holder.taken(2):
        holder.close()  # the kernel drops its locks
        with HostCores(2, path).taken(2) as threads:
            assert threads == 2
    code = (
        "import os, sys; from stagerun.backends._ggml._cores import HostCores\n"
        f"c = HostCores(2, {path!r}); t = c.taken(2); t.__enter__()\n"
        "print('held', flush=True); sys.stdin.read(); os._exit(0)"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "held\n"
            probe = HostCores(2, path)
            assert probe._others_compute()
        finally:
            child.kill()
            child.wait()
        assert not probe._others_compute()


def test_a_lock_file_that_is_not_a_plain_file_of_ours_is_not_used(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    stage = HostCores(2, str(link))
    assert not stage.shared and "cores are not shared" in caplog.text
    with stage.taken(2) as threads:
        assert threads == 2  # as if alone: its full thread count
    if os.getuid() == 0:
        other = tmp_path / "theirs"
        other.touch()
        os.chown(other, 12345, 12345)
        assert not HostCores(2, str(other)).shared
