"""Crafted GGUF metadata: refused, or read, in bounded time and memory, once, before any stage.

The review's file: 12 MiB holding one million empty arrays nested in one array took 55 s and
2.4 GB to open, in stage 0 and again in every stage process. The header walk now counts
nested arrays (and keys and tensors) against bounds that keep gguf's reader to about 2 s.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagerun import ModelError
from stagerun.model._gguf_file import (
    MAX_GGUF_KEYS,
    MAX_GGUF_METADATA_ITEMS,
    MAX_GGUF_NESTED_ARRAYS,
    MAX_GGUF_TENSORS,
    check_gguf_header,
)

U8, STRING, ARRAY = 0, 8, 9


def _str(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _gguf(kvs: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors


def _nested(n: int) -> bytes:
    """One key holding ``n`` empty arrays of bytes: 12 bytes each."""
    return _gguf(
        _str(b"a") + struct.pack("<IIQ", ARRAY, ARRAY, n) + struct.pack("<IQ", U8, 0) * n, 1
    )


def _keys(n: int) -> bytes:
    return _gguf(b"".join(_str(b"k%d" % i) + struct.pack("<IB", U8, 0) for i in range(n)), n)


def _tensors(n: int) -> bytes:
    infos = b"".join(_str(b"t%d" % i) + struct.pack("<IQIQ", 1, 32, 0, 0) for i in range(n))
    return _gguf(tensors=infos, n_tensors=n) + bytes(256)


# Opens the file in a fresh interpreter and reports the time, the peak of Python allocations
# (with "traced": tracemalloc slows allocation-heavy code several times) and the growth of the
# peak RSS that opening it took (the high-water mark is reset first).
_MEASURE = """
import json, sys, time, tracemalloc
from stagerun.model import open_model
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
if sys.argv[2] == "traced":
    tracemalloc.start()
start = time.perf_counter()
try:
    open_model(sys.argv[1])
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
seconds = time.perf_counter() - start
traced = tracemalloc.get_traced_memory()[1] / 2**20
print(json.dumps({"seconds": seconds, "traced_mib": traced,
                  "rss_growth_mib": status("VmHWM:") - before, "error": error}))
"""


def _measure_open(path: Path, *, traced: bool, timeout: float = 30.0) -> dict[str, object]:
    try:
        out = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(path), "traced" if traced else "untraced"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening {path.name} took more than {timeout} s")
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_a_million_nested_arrays_are_refused_within_a_second_and_100_mb(tmp_path: Path) -> None:
    path = tmp_path / "nested.gguf"
    path.write_bytes(_nested(1_000_000))  # 12 MiB
    figures = _measure_open(path, traced=True)
    print(figures)
    assert figures["error"] is not None and "nested arrays" in str(figures["error"])
    assert str(figures["error"]).startswith("ModelError")
    assert isinstance(figures["seconds"], float) and figures["seconds"] < 1.0
    assert isinstance(figures["traced_mib"], float) and figures["traced_mib"] < 100
    assert isinstance(figures["rss_growth_mib"], float) and figures["rss_growth_mib"] < 100


@pytest.mark.parametrize(
    ("name", "data", "problem"),
    [
        ("nested arrays", _nested(MAX_GGUF_NESTED_ARRAYS + 1), "more than the limit of 1024"),
        ("keys", _keys(MAX_GGUF_KEYS + 1), "the metadata key count is 4097, more than"),
        ("tensors", _tensors(MAX_GGUF_TENSORS + 1), "the tensor count is 8193, more than"),
    ],
)
def test_headers_over_the_bounds_are_refused_at_once(
    tmp_path: Path, name: str, data: bytes, problem: str
) -> None:
    path = tmp_path / "over.gguf"
    path.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(ModelError, match=problem):
        check_gguf_header(path)
    assert time.perf_counter() - start < 0.1, name


def test_a_header_at_every_bound_opens_within_seconds(tmp_path: Path) -> None:
    """The worst header the bounds let through: every key, tensor and nested array allowed,
    and 2M strings. gguf's reader took 3.0 s and 258 MB for 65,536 keys, 5.1 s and 381 MB for
    65,536 tensors before the bounds were lowered."""
    n = (MAX_GGUF_METADATA_ITEMS - MAX_GGUF_NESTED_ARRAYS) // 2
    strings = b"".join(
        _str(key) + struct.pack("<IIQ", ARRAY, STRING, n) + _str(b"") * n for key in (b"s", b"z")
    )
    nested = _str(b"a") + struct.pack("<IIQ", ARRAY, ARRAY, MAX_GGUF_NESTED_ARRAYS)
    nested += struct.pack("<IQ", U8, 0) * MAX_GGUF_NESTED_ARRAYS
    n_keys = MAX_GGUF_KEYS - 3
    keys = b"".join(_str(b"k%d" % i) + struct.pack("<IB", U8, 0) for i in range(n_keys))
    infos = b"".join(
        _str(b"t%d" % i) + struct.pack("<IQIQ", 1, 32, 0, 0) for i in range(MAX_GGUF_TENSORS)
    )
    path = tmp_path / "bounds.gguf"
    path.write_bytes(
        _gguf(strings + nested + keys, MAX_GGUF_KEYS, infos, MAX_GGUF_TENSORS) + bytes(256)
    )
    figures = _measure_open(path, traced=False)
    print(figures)
    assert "lacks the GGUF key 'general.architecture'" in str(figures["error"])  # parsed whole
    assert isinstance(figures["seconds"], float) and figures["seconds"] < 4.0
    assert isinstance(figures["rss_growth_mib"], float) and figures["rss_growth_mib"] < 200


async def test_stage_zero_refuses_the_file_before_starting_any_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stagerun import _launch

    async def no_stages(*args: object, **kwargs: object) -> None:
        raise AssertionError("a stage was started for a refused model file")

    monkeypatch.setattr(_launch, "_start_stages", no_stages)
    path = tmp_path / "nested.gguf"
    path.write_bytes(_nested(1_000_000))
    start = time.perf_counter()
    with pytest.raises(ModelError, match="nested arrays"):
        async with _launch.open_pipeline(path, stages=2, mode="processes"):
            pass
    assert time.perf_counter() - start < 1.0
