"""Compute backends: run a stage's layer range. ``NumpyBackend`` is the reference."""

from ._numpy import KVCache as KVCache
from ._numpy import NumpyBackend as NumpyBackend
