"""The public API is what `stagerun/__init__.py` re-exports, and nothing private leaks."""

from __future__ import annotations

import stagerun


def test_public_names() -> None:
    assert sorted(stagerun.__all__) == sorted(
        [
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
    )
    for name in stagerun.__all__:
        assert hasattr(stagerun, name), name


def test_errors_form_one_tree() -> None:
    for name in stagerun.__all__:
        obj = getattr(stagerun, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, stagerun.StagerunError), name
