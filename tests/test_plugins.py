"""The plugin registry: entry points, validation, broken plugins, STAGERUN_PLUGINS, the CLI."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagerun import SpeculationConfig, plugins
from stagerun._cli._main import main
from stagerun._errors import UnsupportedModelError
from stagerun.drafters import NgramDrafter
from stagerun.plugins import PluginError
from stagerun.transports import TcpTransport, WebSocketTransport

MODULE = """
import trio
from stagerun.abc import Transport, Drafter


class GoodTransport(Transport):
    schemes = ("good",)

    async def connect(self, address, *, timeout):
        raise NotImplementedError

    async def serve(self, address, handler, *, task_status=trio.TASK_STATUS_IGNORED):
        raise NotImplementedError


class SyncConnect:
    schemes = ("sync",)

    def connect(self, address, *, timeout):
        return None

    async def serve(self, address, handler, *, task_status=None):
        pass


class NoSchemes:
    async def connect(self, address, *, timeout):
        pass

    async def serve(self, address, handler, *, task_status=None):
        pass


class HalfDrafter(Drafter):
    def begin(self, prompt):
        pass

    def commit(self, tokens):
        pass


class AsyncDrafter:
    def begin(self, prompt):
        pass

    def commit(self, tokens):
        pass

    async def propose(self, context, max_tokens):
        return []


class FirstDrafter(Drafter):
    def begin(self, prompt):
        pass

    def commit(self, tokens):
        pass

    def propose(self, context, max_tokens):
        return [1]


class NoForward:
    def __init__(self, model, layers=None, *, threads=None):
        pass

    layers = (0, 1)
    is_first = is_last = True

    def new_cache(self):
        return None


not_a_class = 42

from stagerun.model import Family

MISNAMED = Family("other")
BRANCHY = Family("branchy", rope_interleaved=False)


def make_branchy():
    return BRANCHY


def failing_family():
    raise RuntimeError("no such luck")
"""


def _fake_distribution(root: Path, name: str, entry_points: str) -> None:
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def fake_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "fakeplug_mod.py").write_text(MODULE)
    _fake_distribution(
        tmp_path,
        "fakeplug",
        """
        [stagerun.transports]
        good = fakeplug_mod:GoodTransport
        gone = fakeplug_missing_module:Thing
        sync = fakeplug_mod:SyncConnect
        noschemes = fakeplug_mod:NoSchemes
        twin = fakeplug_mod:GoodTransport

        [stagerun.drafters]
        half = fakeplug_mod:HalfDrafter
        asyncdrafter = fakeplug_mod:AsyncDrafter
        first = fakeplug_mod:FirstDrafter
        number = fakeplug_mod:not_a_class

        [stagerun.backends]
        noforward = fakeplug_mod:NoForward

        [stagerun.architectures]
        misnamed = fakeplug_mod:MISNAMED
        branchy = fakeplug_mod:make_branchy
        failing = fakeplug_mod:failing_family
        numeric = fakeplug_mod:not_a_class
        llama = fakeplug_mod:BRANCHY
        """,
    )
    _fake_distribution(
        tmp_path,
        "otherplug",
        """
        [stagerun.transports]
        twin = fakeplug_mod:GoodTransport
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.ENV, raising=False)
    plugins.refresh()
    yield tmp_path
    plugins.refresh()


def test_built_ins_come_through_entry_points() -> None:
    plugins.refresh()
    assert {"tcp", "ws"} <= set(plugins.names("transports"))
    assert "numpy" in plugins.names("backends")
    assert {"ngram", "draft-model", "oracle"} <= set(plugins.names("drafters"))
    assert isinstance(plugins.transport("tcp"), TcpTransport)
    assert isinstance(plugins.transport_for("ws://127.0.0.1:1"), WebSocketTransport)
    assert isinstance(plugins.transport_for("127.0.0.1:1"), TcpTransport)  # tcp by default
    assert plugins.drafter("ngram") is NgramDrafter
    info = next(i for i in plugins.installed("transports") if i.name == "tcp")
    assert info.distribution.startswith("stagerun ") and info.status == "loaded"


def test_unknown_names_list_what_is_available() -> None:
    plugins.refresh()
    with pytest.raises(plugins.PluginError, match=r"no transport plugin named 'smoke'.*tcp"):
        plugins.transport("smoke")
    with pytest.raises(plugins.PluginError, match=r"no transport plugin serves carrier://"):
        plugins.transport_for("carrier://pigeon:1")
    with pytest.raises(ValueError, match=r"unknown drafter 'psychic'; choose one of off, "):
        SpeculationConfig("psychic")


def test_a_plugin_that_fails_to_import_names_itself(fake_plugins: Path) -> None:
    with pytest.raises(plugins.PluginError) as excinfo:
        plugins.transport("gone")
    message = str(excinfo.value)
    assert "transport plugin 'gone'" in message
    assert "fakeplug_missing_module:Thing" in message and "fakeplug 1.0" in message
    assert "importing it failed: ModuleNotFoundError" in message
    # The others keep working.
    assert isinstance(plugins.transport("tcp"), TcpTransport)
    assert type(plugins.transport("good")).__name__ == "GoodTransport"


@pytest.mark.parametrize(
    ("kind", "name", "problem"),
    [
        ("transports", "sync", r"its connect\(\) must be an async def"),
        ("transports", "noschemes", r"its schemes must be a non-empty tuple"),
        ("drafters", "half", r"leaves abstract methods unimplemented: propose"),
        ("drafters", "asyncdrafter", r"its propose\(\) must be a plain \(blocking\) def"),
        ("drafters", "number", r"it is a int, not a class"),
        ("backends", "noforward", r"it has no forward\(\)"),
    ],
)
def test_a_plugin_with_the_wrong_interface_is_refused(
    fake_plugins: Path, kind: plugins.Kind, name: str, problem: str
) -> None:
    load = {"transports": plugins.transport, "drafters": plugins.drafter,
            "backends": plugins.backend}[kind]  # fmt: skip
    with pytest.raises(plugins.PluginError, match=problem) as excinfo:
        load(name)
    assert f"plugin {name!r}" in str(excinfo.value) and "fakeplug 1.0" in str(excinfo.value)
    info = next(i for i in plugins.installed(kind) if i.name == name)
    assert info.status == "broken"
    assert name not in plugins.names(kind)
    # Asking again gives the same answer without importing again.
    with pytest.raises(plugins.PluginError, match=problem):
        load(name)


def test_two_distributions_claiming_one_name_is_an_error_naming_both(fake_plugins: Path) -> None:
    with pytest.raises(plugins.PluginError) as excinfo:
        plugins.transport("twin")
    message = str(excinfo.value)
    assert "registered by fakeplug 1.0" in message and "otherplug 1.0" in message
    assert "twin" not in plugins.names("transports")
    assert "good" in plugins.names("transports")


def test_a_third_party_drafter_is_usable_by_name(fake_plugins: Path) -> None:
    assert SpeculationConfig("first").drafter == "first"
    assert plugins.drafter("first")().propose([1, 2], 4) == [1]


BUILT_IN_TRANSPORTS = {"tcp", "ws", "tls", "wss", "mem"}


def test_stagerun_plugins_restricts_only_the_kinds_it_names(
    fake_plugins: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`drafter:first` restricts third-party drafters to `first`; built-ins and the other
    kinds are untouched."""
    monkeypatch.setenv(plugins.ENV, "drafter:first")
    plugins.refresh()
    assert set(plugins.names("drafters")) >= {"ngram", "oracle", "draft-model", "first"}
    assert not {"half", "asyncdrafter", "number"} & set(plugins.names("drafters"))
    with pytest.raises(plugins.PluginError, match=r"'half'.* not listed in STAGERUN_PLUGINS"):
        plugins.drafter("half")
    assert {"good", "sync", "noschemes"} <= set(plugins.names("transports"))  # not restricted
    assert set(plugins.names("transports")) >= BUILT_IN_TRANSPORTS


def test_stagerun_plugins_names_and_distributions_restrict_their_kinds(
    fake_plugins: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugins.ENV, "tcp, drafters:ngram, good")
    plugins.refresh()
    # `good` is a transport: third-party transports are restricted to it; built-ins stay.
    assert set(plugins.names("transports")) == BUILT_IN_TRANSPORTS | {"good"}
    # `drafters:ngram` restricts drafters: none of fakeplug's is listed.
    assert not {"half", "first", "asyncdrafter"} & set(plugins.names("drafters"))
    assert "ngram" in plugins.names("drafters")
    assert "numpy" in plugins.names("backends")
    # A distribution name restricts every kind it has plugins in, to its own.
    monkeypatch.setenv(plugins.ENV, "FakePlug")  # compared as packaging does
    plugins.refresh()
    assert {"good", "tcp", "ws"} <= set(plugins.names("transports"))
    assert {"first", "ngram"} <= set(plugins.names("drafters"))


def test_a_leading_minus_excludes_a_plugin_built_in_or_not(
    fake_plugins: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugins.ENV, "-ws, -transport:good, -drafter:draft-model")
    plugins.refresh()
    transports = set(plugins.names("transports"))
    assert "ws" not in transports and "good" not in transports
    assert {"tcp", "sync", "noschemes"} <= transports  # exclusions restrict nothing else
    assert "draft-model" not in plugins.names("drafters")
    with pytest.raises(plugins.PluginError, match=r"'ws'.* excluded by STAGERUN_PLUGINS"):
        plugins.transport("ws")
    with pytest.raises(plugins.PluginError, match=r"no transport plugin serves ws://"):
        plugins.transport_for("ws://127.0.0.1:1")


@pytest.mark.parametrize(
    "spec",
    ["ngram,bigram", "drafter:ngram", "transports:ws", "stagerun-unix", "drafter:bigram, -ws"],
)
async def test_the_documented_stagerun_plugins_examples_keep_stagerun_working(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    """Every value the docs show: a speculative pipeline over tcp on numpy still runs."""
    from stagerun import open_pipeline

    monkeypatch.setenv(plugins.ENV, spec)
    plugins.refresh()
    try:
        assert {"tcp", "numpy", "ngram"} <= {
            *plugins.names("transports"),
            *plugins.names("backends"),
            *plugins.names("drafters"),
        }
        async with open_pipeline(tiny_model_path, stages=2) as pipeline:
            result = await pipeline.complete(
                "one two three", max_tokens=8, speculation=SpeculationConfig("ngram", depth=2)
            )
        assert len(result.token_ids) == 8
    finally:
        plugins.refresh()


def test_cli_lists_plugins_and_their_problems(
    fake_plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugins", "--load"]) == 1  # broken plugins make it fail
    out = capsys.readouterr().out
    assert "tcp" in out and "[loaded]" in out
    assert "gone" in out and "importing it failed" in out
    assert "registered by fakeplug 1.0" in out
    plugins.refresh()
    assert main(["plugins", "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    twin = next(r for r in rows if r["name"] == "twin")
    assert twin["status"] == "broken" and "otherplug" in twin["distribution"]


def test_cli_is_clean_without_broken_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    plugins.refresh()
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "transports:" in out and "ws" in out and "numpy" in out


async def test_the_example_drafter_plugin_drives_speculation(tiny_model_path: Path) -> None:
    """examples/custom_drafter, installed by `make test`, chosen by its entry point name."""
    from stagerun import open_pipeline

    plugins.refresh()
    assert "bigram" in plugins.names("drafters")
    async with open_pipeline(tiny_model_path, stages=2) as pipeline:
        prompt = "one two three one two three one two"
        plain = await pipeline.complete(prompt, max_tokens=16)
        spec = await pipeline.complete(
            prompt, max_tokens=16, speculation=SpeculationConfig("bigram", depth=2, window=3)
        )
    assert spec.token_ids == plain.token_ids
    assert spec.timings["speculative_windows"] > 0


def test_takes_device_reads_the_backend_signature() -> None:
    plugins.refresh()
    assert not plugins.takes_device("numpy")
    assert plugins.takes_device("torch")


def test_flash_attention_goes_only_to_a_backend_that_takes_it() -> None:
    assert plugins.takes("ggml", "flash_attention")
    assert not plugins.takes("numpy", "flash_attention")
    with pytest.raises(plugins.PluginError, match="numpy backend has no flash attention option"):
        plugins.build_backend("numpy", "unused", None, threads=None, flash_attention=False)


def test_family_plugins_are_checked_by_name_and_type(
    fake_plugins: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stagerun.model import FAMILIES, family_of, open_model
    from stagerun.testing import write_tiny_model

    assert plugins.family("branchy").name == "branchy"  # a factory is called
    with pytest.raises(PluginError, match="named 'other', but it is registered for the 'misnamed'"):
        plugins.family("misnamed")
    with pytest.raises(PluginError, match="calling it failed: RuntimeError: no such luck"):
        plugins.family("failing")
    with pytest.raises(PluginError, match=r"it is a int, not a stagerun\.model\.Family"):
        plugins.family("numeric")
    # a plugin cannot take a built-in's name: the built-in wins, with a warning
    assert plugins.family("llama") is FAMILIES["llama"]
    assert "stagerun's built-in architecture of that name wins" in caplog.text
    assert family_of("llama") is FAMILIES["llama"]
    # a file of the plugin's architecture opens as its family; a broken one says why
    path = write_tiny_model(tmp_path / "b.gguf", family=plugins.family("branchy"))
    assert open_model(path).config.family.name == "branchy"
    with pytest.raises(UnsupportedModelError, match=r"'misnamed' model .*named 'other'"):
        family_of("misnamed", "m.gguf")


def test_the_docs_sample_lists_stageruns_own_plugins_as_registered() -> None:
    """docs/plugins.md's `stagerun plugins` sample: stagerun's own lines are what it registers."""
    import importlib.metadata
    import re

    docs = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    sample = docs.split("$ stagerun plugins\n", 1)[1].split("```", 1)[0]
    shown = set(re.findall(r"^  (\S+) +(\S+) +stagerun 0\.1\.0", sample, re.MULTILINE))
    groups = [g for g in importlib.metadata.distribution("stagerun").entry_points
              if g.group.startswith("stagerun.")]  # fmt: skip
    registered = {(ep.name, ep.value) for ep in groups}
    assert shown == registered
