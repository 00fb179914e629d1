"""The ggml backend: a stage's layers on the GGUF file's own quantized blocks (`GgmlBackend`)."""

from ._backend import GgmlBackend as GgmlBackend
from ._kv import GgmlKVBlock as GgmlKVBlock
from ._kv import GgmlKVCache as GgmlKVCache
from ._lib import GgmlUnavailableError as GgmlUnavailableError
from ._lib import unavailable as unavailable
