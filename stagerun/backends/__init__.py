"""Compute backends: run a stage's layer range.

``GgmlBackend`` computes on the file's quantized blocks (the default where it runs);
``NumpyBackend`` is the float32 reference.
"""

from ._ggml import GgmlBackend as GgmlBackend
from ._ggml import GgmlKVBlock as GgmlKVBlock
from ._ggml import GgmlKVCache as GgmlKVCache
from ._ggml import GgmlUnavailableError as GgmlUnavailableError
from ._inputs import check_positions as check_positions
from ._inputs import forward_one as forward_one
from ._inputs import poll_stops as poll_stops
from ._inputs import stage_input as stage_input
from ._layers import GgufLayers as GgufLayers
from ._numpy import NumpyBackend as NumpyBackend
from ._numpy import NumpyKVCache as NumpyKVCache
