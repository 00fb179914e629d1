"""The stage engine: what every stage, stage 0 included, is apart from its network.

`StageEngine` owns a stage's tick batcher, prefix cache, session budget and stale-work
counters, and is the one home of what a stage does with a request (open, restore, compute,
answer, remember, close). The stage server (`stagerun._stage`) and the driver
(`stagerun._driver`) each hold one and only carry messages to and from it. `StageConfig` is
every setting of a stage, declared and checked in one place (`stagerun._engine._config`).
"""

from ._batcher import INLINE_SECONDS as INLINE_SECONDS
from ._batcher import TickBatcher as TickBatcher
from ._batcher import TickInfo as TickInfo
from ._budget import DEFAULT_MAX_KV_TOKENS as DEFAULT_MAX_KV_TOKENS
from ._budget import DEFAULT_MAX_SESSIONS as DEFAULT_MAX_SESSIONS
from ._budget import SessionBudget as SessionBudget
from ._config import StageConfig as StageConfig
from ._engine import SessionRefused as SessionRefused
from ._engine import StageEngine as StageEngine
from ._grammar import GrammarError as GrammarError
from ._grammar import Grammars as Grammars
from ._grammar import model_grammars as model_grammars
from ._prefix import DEFAULT_PREFIX_CACHE_MB as DEFAULT_PREFIX_CACHE_MB
from ._prefix import PrefixCache as PrefixCache
from ._session import Session as Session
from ._session import StopCheck as StopCheck
