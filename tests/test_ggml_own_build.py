"""The ggml backend on a ggml build of one's own (``STAGERUN_GGML_LIBRARY``).

llama.cpp's build here (``make test`` compiles it: ggml 0.25.3, AVX-512, llamafile's kernels)
computes a step 5-11% faster than the wheel's ggml. The backend's exactness holds on it for
what it accepts: the real models' quantized weights with flash attention (the promises of
tests/test_ggml_backend.py and test_ggml_slabs.py, run again in a process of their own);
float weights and attention without flash attention, whose sums llamafile's kernels make
depend on the rows computed together, are refused with the reason.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from stagerun.backends._ggml import _lib
from stagerun.backends._ggml._lib import BF16, F16, F32, LIBRARY_ENV, check_row_kernels
from stagerun.backends._ggml._omp import on_compute_thread
from stagerun.model import ModelFile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LLAMA_GGML = ROOT / ".cache" / "llama.cpp" / "bin" / "libggml.so"
WHEEL_GGML = pathlib.Path(_lib._wheel_folder()) / "libggml.so.0"

# tests/test_ggml_backend.py's promises on the real models, with flash attention (the default)
EXACTNESS = [
    "test_flash_attention_computes_the_same_in_any_chunks_and_would_not_with_its_tiles",
    "test_a_decode_step_over_many_keys_is_the_same_on_one_thread_and_two",
    "test_decode_steps_reuse_a_kept_graph_and_compute_what_one_whole_forward_does",
    "test_sessions_batched_compute_what_each_computes_alone_on_both_stages",
    "test_two_threads_compute_bitwise_what_one_does",
    "test_a_long_prefill_is_cut_into_graphs_and_polled_between_them",
    "test_interrupt_stops_a_graph_between_its_nodes",
    "test_greedy_tokens_equal_llama_cpp_s_up_to_near_ties_on_the_real_models and flash",
    # and tests/test_ggml_slabs.py's: sessions attending together, each its own
    "test_sessions_in_consecutive_slots_attend_in_one_group_and_each_gets_its_own",
    "test_sessions_around_a_free_slot_and_across_slabs_compute_what_each_does_alone",
    "test_a_group_s_decode_over_many_keys_is_the_same_on_one_thread_and_two",
]


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_the_backend_s_exactness_holds_on_llama_cpp_s_ggml() -> None:
    """Batched == solo, chunked == whole, 2 threads == 1, and llama.cpp's tokens, on the
    build with llamafile's kernels (in a process of its own: one ggml is loaded per process).
    The library is checked first to be that build, so the run cannot pass on the wheel's."""
    env = {**os.environ, LIBRARY_ENV: str(LLAMA_GGML)}
    probe = (
        "from stagerun.backends._ggml._lib import load; ffi, lib = load(); "
        "print(ffi.string(lib.ggml_version()).decode(), lib.ggml_cpu_has_llamafile())"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["0.25.3", "1"], out.stdout + out.stderr
    assert "is a ggml built with OpenMP" in out.stderr  # llama.cpp's default: it says so
    selected = " or ".join(f"({name})" for name in EXACTNESS)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         str(ROOT / "tests" / "test_ggml_backend.py"), str(ROOT / "tests" / "test_ggml_slabs.py"),
         "-k", selected],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert run.stdout.splitlines()[-1].startswith("14 passed, "), tail  # none skipped


def _lib_with(llamafile: bool) -> SimpleNamespace:
    return SimpleNamespace(ggml_cpu_has_llamafile=lambda: int(llamafile))


def test_float_weights_and_softmax_attention_are_refused_only_with_llamafile() -> None:
    quantized = {"blk.0.attn_q.weight": 8, "token_embd.weight": 8}  # Q8_0
    floats = {**quantized, "blk.0.ffn_up.weight": F16, "output.weight": F32, "x": BF16}
    check_row_kernels(_lib_with(llamafile=True), quantized, flash=True)
    for matrices, flash in ((floats, True), (quantized, False)):
        check_row_kernels(_lib_with(llamafile=False), matrices, flash=flash)
    with pytest.raises(ValueError, match=r"float weights \(blk\.0\.ffn_up\.weight, output"):
        check_row_kernels(_lib_with(llamafile=True), floats, flash=True)
    with pytest.raises(ValueError, match="attention without flash attention"):
        check_row_kernels(_lib_with(llamafile=True), quantized, flash=False)


def test_a_named_build_is_loaded_in_place_of_the_wheel_s_and_its_version_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wheel's own folder, named: it loads (0.20.2 is compatible), and is refused once
    its version is not among the compatible ones."""
    monkeypatch.setenv(LIBRARY_ENV, str(WHEEL_GGML))
    ffi, lib = _lib.load.__wrapped__()
    assert ffi.string(lib.ggml_version()).decode() == "0.20.2"
    monkeypatch.setattr(_lib, "COMPATIBLE_VERSIONS", frozenset({"0.25.3"}))
    with pytest.raises(_lib.GgmlUnavailableError, match=rf"{LIBRARY_ENV} names ggml 0\.20\.2"):
        _lib.load.__wrapped__()


def test_a_named_path_that_is_not_a_shared_ggml_build_is_refused_with_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    lone = tmp_path / "lone" / "libggml.so.0"
    lone.parent.mkdir()
    lone.write_bytes(WHEEL_GGML.read_bytes())
    for named, missing in (
        (tmp_path / "libggml.so", "no libggml.so.0, libggml-base.so.0, libggml-cpu.so.0"),
        (lone, "no libggml-base.so.0, libggml-cpu.so.0"),
    ):
        monkeypatch.setenv(LIBRARY_ENV, str(named))
        with pytest.raises(_lib.GgmlUnavailableError, match=missing):
            _lib.load.__wrapped__()


def test_with_openmp_every_graph_is_computed_on_one_thread_whoever_asks() -> None:
    """An OpenMP ggml computes at full speed on the first thread of a process that computes
    (`_omp`): the graphs the event loop and worker threads ask for all run on one thread."""
    ran: list[int] = []

    def work() -> int:
        ran.append(threading.get_ident())
        return len(ran)

    callers = [threading.Thread(target=on_compute_thread, args=(True, work)) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert on_compute_thread(True, work) == 4
    assert len(set(ran)) == 1 and ran[0] != threading.get_ident()
    assert on_compute_thread(False, work) == 5 and ran[-1] == threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        on_compute_thread(True, lambda: 1 // 0)
    assert on_compute_thread(True, work) == 6  # the thread lives on after a failure


def test_a_build_that_does_not_look_beside_itself_for_its_libraries_loads(
    tmp_path: pathlib.Path,
) -> None:
    """A ggml built in its own tree links its libraries by the build's path, not ``$ORIGIN``
    (here the wheel's, that string overwritten): the private copies are loaded base first,
    so the main one's links find them by soname (in a fresh process: one that loaded the
    wheel already holds a library of that soname)."""
    build = tmp_path / "build"
    build.mkdir()
    for name in ("libggml.so.0", "libggml-base.so.0", "libggml-cpu.so.0"):
        data = (WHEEL_GGML.parent / name).read_bytes()
        assert b"$ORIGIN\0" in data
        (build / name).write_bytes(data.replace(b"$ORIGIN\0", b"/nowher\0"))
    env = {
        **os.environ,
        LIBRARY_ENV: str(build / "libggml.so.0"),
        "STAGERUN_CACHE": str(tmp_path / "cache"),
    }
    probe = "from stagerun.backends._ggml._lib import load; load()"
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_backend_checks_every_matrix_it_multiplies_by_and_no_other(
    monkeypatch: pytest.MonkeyPatch, smollm2: ModelFile
) -> None:
    """Its layers' matrices (not their norms), the head on the last stage only (SmolLM2's is
    the tied embedding table, which the first stage only looks rows up in), and the flag."""
    from stagerun.backends import GgmlBackend
    from stagerun.backends._ggml import _backend

    seen: list[tuple[dict[str, int], bool]] = []
    monkeypatch.setattr(
        _backend, "check_row_kernels", lambda lib, m, *, flash: seen.append((m, flash))
    )
    GgmlBackend(smollm2, (0, 2))
    GgmlBackend(smollm2, (28, 30), flash_attention=False)
    (first, flash_first), (last, flash_last) = seen
    per_layer = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    assert {n.split(".")[2] for n in first} == per_layer and "token_embd.weight" not in first
    assert {int(n.split(".")[1]) for n in first} == {0, 1}
    assert {n for n in last if not n.startswith("blk.")} == {"token_embd.weight"}
    assert last["token_embd.weight"] == 8 and first["blk.0.attn_q.weight"] == 3  # Q8_0, Q4_1
    assert (flash_first, flash_last) == (True, False)
