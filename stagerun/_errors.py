"""One error tree for everything stagerun raises.

Errors are translated at the boundary where they happen (a socket, a GGUF file, a frame) with
``raise ... from exc``, so a user sees one plain sentence saying what was wrong and what to do.
"""

from __future__ import annotations


class StagerunError(Exception):
    """Base class of every error stagerun raises on purpose."""


class ProtocolError(StagerunError):
    """Malformed or unexpected bytes on the wire (frame, handshake or message)."""


class ModelError(StagerunError):
    """A model file cannot be used."""


class ModelNotFoundError(ModelError):
    """The model file does not exist, or the named model is not installed."""


class UnsupportedModelError(ModelError):
    """The GGUF file uses an architecture or tensor type stagerun cannot run."""


class LayerRangeError(ModelError, ValueError):
    """A stage's layer range lies outside the model."""


class LaneError(StagerunError):
    """A lane to a downstream stage failed."""


class RecoveryFailedError(LaneError):
    """A request lost its lane and could not get a working one back within its budget."""


class StageGivenUpError(RecoveryFailedError):
    """A request lost its lane and none can come back: the supervisor gave a stage up."""


class LaneHandshakeError(LaneError):
    """A lane could not be opened: connect failed, or the peer never said READY."""


class LaneBrokenError(LaneError):
    """A lane lost its connection or its peer sent something it must not."""


class LaneTimeoutError(LaneError):
    """A peer did not answer within the reply timeout."""


class StageError(StagerunError):
    """A stage reported that it could not carry out a request."""


class PipelineClosedError(StagerunError):
    """The pipeline was closed, or is used from a Trio run other than the one that opened it."""


class ComputeCancelled(StagerunError):
    """A compute was stopped at a layer boundary because its work went stale."""


class VerifyWindowError(ProtocolError):
    """A verify window broke the pipeline's order: full pipeline, out-of-order or short reply."""
