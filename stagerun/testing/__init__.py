"""Public helpers for testing stagerun and its plugins without the real model.

* `write_tiny_model`: a small random-weight GGUF that loads and runs like the real model.
* `MemoryTransport`: lanes over in-memory streams (``mem://NAME``), no sockets.
* `FakeBackend`: a fast deterministic backend whose greedy output is known in advance.
* `check_transport`, `check_backend`, `check_drafter`, `check_family`: the conformance
  suites every plugin (stagerun's own included) must pass.
"""

from ._conformance import check_backend as check_backend
from ._conformance import check_drafter as check_drafter
from ._conformance import check_family as check_family
from ._conformance import check_transport as check_transport
from ._fake_backend import FakeBackend as FakeBackend
from ._memory import MemoryTransport as MemoryTransport
from ._tiny_model import write_tiny_model as write_tiny_model

__all__ = [
    "FakeBackend",
    "MemoryTransport",
    "check_backend",
    "check_drafter",
    "check_family",
    "check_transport",
    "write_tiny_model",
]
