"""stagerun: run one language model split by layers across a pipeline of stages, on Trio.

The public API is re-exported here; everything else lives in private modules, grouped by the
side of a lane they run on. The layers, lowest first; each imports only from itself and from
layers below it (tests/test_layers.py checks this on the import graph):

1. base: the error tree (``_errors``), small helpers, ``telemetry``, ``_orphans`` (which
   ``import stagerun`` runs before anything heavy);
2. ``_proto``: the wire format, sans-IO (bytes in, values out);
3. ``_decide``: the decisions, sans-IO (windows, verdicts, speculation, pace, prefill
   planning, sampling); like ``_proto`` it never imports Trio, sockets, threads or a clock;
4. ``model`` and ``plugins``: GGUF files, tokenizers; the entry-point registry;
5. ``_wire``: both ends of a lane (framed streams with deadlines, handshakes, dialling, secrets);
6. ``abc``: the plugin interfaces, declared once;
7. ``transports``, ``backends``, ``drafters``: the built-in plugins;
8. ``_engine``: the stage engine (every stage's settings, `StageConfig`);
9. ``_stage``: the stage side (the stage server and its lane workers);
10. ``_driver``: stage 0 (configuration, launch, supervision, the lane pool, requests);
11. ``server`` (the HTTP API) and ``testing`` (the plugin authors' kit);
12. ``_cli``: the command line and its benchmarks.
"""

from . import (
    _blas,  # noqa: F401  (must run before numpy loads OpenBLAS)
    _orphans,  # noqa: F401  (before the heavy imports: a supervised child dies with its parent)
)
from ._driver._config import PipelineConfig as PipelineConfig
from ._driver._config import PipelinePlan as PipelinePlan
from ._driver._config import RecoveryPolicy as RecoveryPolicy
from ._driver._config import SpeculationConfig as SpeculationConfig
from ._driver._config import StagePlan as StagePlan
from ._driver._config import SupervisionPolicy as SupervisionPolicy
from ._driver._config import plan as plan
from ._driver._config import split_layers as split_layers
from ._driver._lanes import Lane as Lane
from ._driver._lanes import LanePool as LanePool
from ._driver._pipeline import Pipeline as Pipeline
from ._driver._values import Completion as Completion
from ._driver._values import GenerationStream as GenerationStream
from ._driver._values import StageHealth as StageHealth
from ._driver._values import StageInfo as StageInfo
from ._driver._values import TokenChunk as TokenChunk
from ._driver._values import TokenLogprob as TokenLogprob
from ._errors import ComputeCancelled as ComputeCancelled
from ._errors import LaneBrokenError as LaneBrokenError
from ._errors import LaneError as LaneError
from ._errors import LaneHandshakeError as LaneHandshakeError
from ._errors import LaneTimeoutError as LaneTimeoutError
from ._errors import LayerRangeError as LayerRangeError
from ._errors import ModelError as ModelError
from ._errors import ModelNotFoundError as ModelNotFoundError
from ._errors import PipelineClosedError as PipelineClosedError
from ._errors import ProtocolError as ProtocolError
from ._errors import RecoveryFailedError as RecoveryFailedError
from ._errors import StageError as StageError
from ._errors import StagerunError as StagerunError
from ._errors import UnsupportedModelError as UnsupportedModelError
from ._launch import open_pipeline as open_pipeline
from ._proto import SamplingParams as SamplingParams
from ._stage._server import StageServer as StageServer
from ._stage._server import serve_stage as serve_stage

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
    "PipelineClosedError",
    "PipelineConfig",
    "PipelinePlan",
    "ProtocolError",
    "RecoveryFailedError",
    "RecoveryPolicy",
    "SamplingParams",
    "SpeculationConfig",
    "StageError",
    "StageHealth",
    "StageInfo",
    "StagePlan",
    "StageServer",
    "StagerunError",
    "SupervisionPolicy",
    "TokenChunk",
    "TokenLogprob",
    "UnsupportedModelError",
    "__version__",
    "open_pipeline",
    "plan",
    "serve_stage",
    "split_layers",
]
