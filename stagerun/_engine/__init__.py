"""The stage engine: what every stage, stage 0 included, is apart from its network.

`StageConfig` is every setting of a stage, declared and checked in one place
(`stagerun._engine._config`).
"""

from ._config import StageConfig as StageConfig

__all__ = ["StageConfig"]
