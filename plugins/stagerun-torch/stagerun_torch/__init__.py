"""A PyTorch compute backend for stagerun (backend name ``torch``)."""

from ._backend import TorchBackend as TorchBackend
from ._backend import TorchKVCache as TorchKVCache

__all__ = ["TorchBackend", "TorchKVCache"]
