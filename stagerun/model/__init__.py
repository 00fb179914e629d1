"""GGUF models: resolving names, reading shapes and weights, tokenizing, chat templates."""

from ._chat import CHATML_TEMPLATE as CHATML_TEMPLATE
from ._chat import ChatTemplateError as ChatTemplateError
from ._chat import render_chat as render_chat
from ._families import FAMILIES as FAMILIES
from ._families import Family as Family
from ._families import make_family as make_family
from ._fused import FusedLayer as FusedLayer
from ._fused import fuse_layer as fuse_layer
from ._fused import qk_row_order as qk_row_order
from ._gguf import LayerWeights as LayerWeights
from ._gguf import ModelConfig as ModelConfig
from ._gguf import ModelFile as ModelFile
from ._gguf import QuantizedTensor as QuantizedTensor
from ._gguf import StageWeights as StageWeights
from ._gguf import StoredTensor as StoredTensor
from ._gguf import family_of as family_of
from ._gguf import open_model as open_model
from ._resolve import KNOWN_MODELS as KNOWN_MODELS
from ._resolve import KnownModel as KnownModel
from ._resolve import model_cache_dir as model_cache_dir
from ._resolve import resolve_model as resolve_model
from ._tokenizer import StreamDecoder as StreamDecoder
from ._tokenizer import Tokenizer as Tokenizer
