"""Conformance suites for plugins: what a transport, backend, drafter or model family must do.

A plugin author calls these from their own tests, as stagerun does for its built-ins::

    async def test_my_transport() -> None:
        await check_transport(MyTransport(), "myscheme://127.0.0.1:0")

    def test_my_backend(model: ModelFile) -> None:
        check_backend(MyBackend, model)

    def test_my_drafter() -> None:
        check_drafter(MyDrafter)

    def test_my_family() -> None:
        check_family(MY_FAMILY)  # a stagerun.model.Family, registered by its entry point

Theory of operation: each suite runs a fixed list of named checks against the plugin through
its public interface only (`stagerun.abc`), using stagerun's own frame codec and handshake
where the runtime would. The first check that fails raises `AssertionError` whose message
starts with the suite and the check's name (``check_transport: a 1 MiB frame, both ways at
once: ...``) and says what was expected; an unexpected exception inside a check is reported
the same way (chained), and so is a hang: every transport check runs under a deadline.
"""

from ._backend import check_backend as check_backend
from ._drafter import check_drafter as check_drafter
from ._family import check_family as check_family
from ._transport import check_transport as check_transport

__all__ = ["check_backend", "check_drafter", "check_family", "check_transport"]
