"""Compute backends: run a stage's layer range. ``NumpyBackend`` is the reference."""

from ._inputs import check_positions as check_positions
from ._inputs import forward_one as forward_one
from ._inputs import poll_stops as poll_stops
from ._inputs import stage_input as stage_input
from ._layers import GgufLayers as GgufLayers
from ._numpy import NumpyBackend as NumpyBackend
from ._numpy import NumpyKVCache as NumpyKVCache
