"""llama.cpp for stagerun: the ``llamacpp`` backend and the ``llama-server`` drafter.

The backend's module loads llama-cpp-python's libraries, so it is imported on first use of
`LlamaCppBackend` or `LlamaCppCache`: the ``llama-server`` drafter (which only talks HTTP) and
`slice_model` work where llama-cpp-python is not installed.
"""

from typing import TYPE_CHECKING, Any

from ._server_drafter import LlamaServerDrafter as LlamaServerDrafter
from ._slice import slice_model as slice_model

if TYPE_CHECKING:
    from ._backend import LlamaCppBackend as LlamaCppBackend
    from ._backend import LlamaCppCache as LlamaCppCache

__all__ = ["LlamaCppBackend", "LlamaCppCache", "LlamaServerDrafter", "slice_model"]


def __getattr__(name: str) -> Any:
    if name in ("LlamaCppBackend", "LlamaCppCache"):
        from . import _backend

        return getattr(_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
