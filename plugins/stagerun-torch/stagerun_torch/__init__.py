"""A PyTorch compute backend for stagerun (backends ``torch`` and ``torch-int4``)."""

from ._backend import TorchBackend as TorchBackend
from ._backend import TorchInt4Backend as TorchInt4Backend
from ._cache import TorchKVCache as TorchKVCache

__all__ = ["TorchBackend", "TorchInt4Backend", "TorchKVCache"]
