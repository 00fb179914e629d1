"""BLAS worker threads must sleep between a stage's computes.

OpenBLAS keeps its worker threads spinning for 2**28 cycles (about 0.1 s) after every call. In
a pipeline the stages take turns: while stage 1 computes, stage 0's workers are still spinning
on the same cores, and on a small machine decode collapses (measured here on 2 cores, 2
threads per stage: 3 stage processes ran at 0.18x one stage). A spin of 2**16 cycles (tens of
microseconds) outlasts the Python gap between two products of one forward but ends long before
the next stage hands work back. It brings 2 and 3 stage processes to 0.92x and 0.84-0.90x of
one stage (docs/benchmarks.md).

The variable is read when OpenBLAS loads, so it is set here, before stagerun imports numpy,
and passed to every stage process stagerun spawns. A value already in the environment wins.
"""

from __future__ import annotations

import os

OPENBLAS_SPIN_ENV = "OPENBLAS_THREAD_TIMEOUT"
OPENBLAS_SPIN_DEFAULT = "16"

os.environ.setdefault(OPENBLAS_SPIN_ENV, OPENBLAS_SPIN_DEFAULT)
