"""llama.cpp for stagerun: the ``llamacpp`` backend and the ``llama-server`` drafter."""

from ._backend import LlamaCppBackend as LlamaCppBackend
from ._backend import LlamaCppCache as LlamaCppCache
from ._server_drafter import LlamaServerDrafter as LlamaServerDrafter
from ._slice import slice_model as slice_model

__all__ = ["LlamaCppBackend", "LlamaCppCache", "LlamaServerDrafter", "slice_model"]
