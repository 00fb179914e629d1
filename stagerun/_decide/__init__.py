"""The decisions, sans-IO: what to send, what to commit, how big the next chunk is.

Pure state machines and functions over values: the verify-window scheduler, the acceptance
rule (verdicts), the speculation controller, pace and depth control, prefill chunk planning
with its transport estimate, and sampling. Nothing here awaits, reads a clock, or touches a
socket: callers pass in times and events and carry out the commands that come back (the Trio
shells are in `stagerun._driver` and `stagerun._stage`). It imports only `stagerun._proto` and
the error tree; tests/test_layers.py checks that.
"""

from ._commands import Command as Command
from ._commands import Commit as Commit
from ._commands import DraftRequest as DraftRequest
from ._commands import Finish as Finish
from ._commands import FinishReason as FinishReason
from ._commands import NewEpoch as NewEpoch
from ._commands import SendWindow as SendWindow
from ._commands import WindowTimings as WindowTimings
from ._measured import SpeculationTimings as SpeculationTimings
from ._speculation import SpeculationController as SpeculationController
from ._verdict import SpeculationStats as SpeculationStats
from ._verdict import Verdict as Verdict
from ._verdict import VerdictKind as VerdictKind
from ._verdict import accept_window as accept_window
from ._verdict import compose_target_predictions as compose_target_predictions
from ._verdict import speculation_timings as speculation_timings
from ._windows import MAX_VERIFY_WINDOW_DEPTH as MAX_VERIFY_WINDOW_DEPTH
from ._windows import VerifyWindow as VerifyWindow
from ._windows import VerifyWindowScheduler as VerifyWindowScheduler
from ._windows import VerifyWindowStats as VerifyWindowStats
from ._windows import response_timings as response_timings
from ._windows import telemetry_attributes as telemetry_attributes
