"""A ggml `Graph` writes its output straight into a fresh array of the caller's.

Callers keep a tick's output rows past the next tick (a request samples from its logits
while the stage computes on), so every compute gets an array of its own; the graph writes
into it in place of copying the output out of its layout (3 MB a 16-session SmolLM2 tick).
"""

from __future__ import annotations

import numpy as np
import pytest

from stagerun.backends._ggml import _graph, _lib

pytestmark = pytest.mark.skipif(_lib.unavailable() is not None, reason="ggml cannot run here")


def test_a_graph_writes_its_output_into_each_computes_own_array() -> None:
    ffi, lib = _lib.load()
    cpu = lib.ggml_backend_cpu_init()
    g = _graph.Graph(ffi, lib, 16, own_allocator=True)
    try:
        a, b = g.input(_lib.F32, 3, 40), g.input(_lib.F32, 3, 40)
        out = lib.ggml_add(g.ctx, a, b)
        lib.ggml_set_output(out)
        g.expand(out)
        rng = np.random.default_rng(7)
        results, laid_out = [], None
        for _ in range(3):
            x, y = (rng.standard_normal((3, 40)).astype(np.float32) for _two in range(2))
            array = g.output_array(out, (3, 40))
            assert array.ctypes.data % 64 == 0 and array.shape == (3, 40)
            g.compute(cpu, [x, y], into=(out, array))
            laid_out = laid_out or int(ffi.cast("uintptr_t", out.data))
            assert int(ffi.cast("uintptr_t", out.data)) == laid_out  # the layout's, again
            np.testing.assert_array_equal(array, x + y)
            results.append((array, x + y))
        for array, expected in results:  # each compute's array is still its own
            np.testing.assert_array_equal(array, expected)
        with pytest.raises(ValueError, match="float32 array of shape"):
            g.output_array(out, (40, 3))
    finally:
        g.close()
        lib.ggml_backend_free(cpu)


def test_a_graph_refuses_an_array_that_is_not_its_outputs_size() -> None:
    ffi, lib = _lib.load()
    cpu = lib.ggml_backend_cpu_init()
    g = _graph.Graph(ffi, lib, 16, own_allocator=True)
    try:
        a = g.input(_lib.F32, 2, 8)
        out = lib.ggml_scale(g.ctx, a, 2.0)
        lib.ggml_set_output(out)
        g.expand(out)
        x = np.arange(16, dtype=np.float32).reshape(2, 8) - 5.0
        for wrong in (np.empty((2, 7), np.float32), np.empty((8, 2), np.float32).T):
            with pytest.raises(ValueError):
                g.compute(cpu, [x], into=(out, wrong))
        right = g.output_array(out, (2, 8))
        g.compute(cpu, [x], into=(out, right))
        np.testing.assert_array_equal(right, 2 * x)
    finally:
        g.close()
        lib.ggml_backend_free(cpu)
