"""stagerun: run one language model split by layers across a pipeline of stages, on Trio.

The public API is re-exported here; everything else lives in private modules.
"""

from . import _blas  # noqa: F401  (must run before numpy loads OpenBLAS)
from ._errors import ComputeCancelled as ComputeCancelled
from ._errors import LaneBrokenError as LaneBrokenError
from ._errors import LaneError as LaneError
from ._errors import LaneHandshakeError as LaneHandshakeError
from ._errors import LaneTimeoutError as LaneTimeoutError
from ._errors import LayerRangeError as LayerRangeError
from ._errors import ModelError as ModelError
from ._errors import ModelNotFoundError as ModelNotFoundError
from ._errors import ProtocolError as ProtocolError
from ._errors import RecoveryFailedError as RecoveryFailedError
from ._errors import StageError as StageError
from ._errors import StagerunError as StagerunError
from ._errors import UnsupportedModelError as UnsupportedModelError
from ._lanes import Lane as Lane
from ._lanes import LanePool as LanePool
from ._launch import open_pipeline as open_pipeline
from ._launch import split_layers as split_layers
from ._pipeline import Pipeline as Pipeline
from ._pipeline_values import Completion as Completion
from ._pipeline_values import GenerationStream as GenerationStream
from ._pipeline_values import RecoveryPolicy as RecoveryPolicy
from ._pipeline_values import StageHealth as StageHealth
from ._pipeline_values import StageInfo as StageInfo
from ._pipeline_values import TokenChunk as TokenChunk
from ._proto import SamplingParams as SamplingParams
from ._speculative import SpeculationConfig as SpeculationConfig
from ._stage import StageServer as StageServer
from ._stage import serve_stage as serve_stage
from ._supervise import SupervisionPolicy as SupervisionPolicy

__version__ = "0.1.0"

__all__ = [
    "Completion",
    "ComputeCancelled",
    "GenerationStream",
    "Lane",
    "LaneBrokenError",
    "LaneError",
    "LaneHandshakeError",
    "LanePool",
    "LaneTimeoutError",
    "LayerRangeError",
    "ModelError",
    "ModelNotFoundError",
    "Pipeline",
    "ProtocolError",
    "RecoveryFailedError",
    "RecoveryPolicy",
    "SamplingParams",
    "SpeculationConfig",
    "StageError",
    "StageHealth",
    "StageInfo",
    "StageServer",
    "StagerunError",
    "SupervisionPolicy",
    "TokenChunk",
    "UnsupportedModelError",
    "__version__",
    "open_pipeline",
    "serve_stage",
    "split_layers",
]
