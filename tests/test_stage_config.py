"""`StageConfig`: every stage setting declared and checked once, and carried by the command line.

The round trip ``from_args(parse(to_argv(c))) == c`` over generated configurations is what
keeps the launcher from dropping a setting on its way to a stage process. The lane secret is
the exception on purpose: it never goes on a command line.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import trio
from _oracle import assert_varied
from hypothesis import given, settings
from hypothesis import strategies as st

from stagerun import LaneHandshakeError, StageInfo, open_pipeline
from stagerun._cli._options import build_parser
from stagerun._driver._lanes import LanePool
from stagerun._driver._pipeline import Pipeline
from stagerun._engine import StageConfig
from stagerun._engine import _config as engine
from stagerun._engine._config import SecretFile, StageCompute, to_argv
from stagerun._stage._connections import connect_downstream
from stagerun._stage._server import StageServer, serve_stage
from stagerun._wire._auth import SECRET_ENV, SECRET_FILE_ENV
from stagerun._wire._connect import ENV_SECRET
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

SECRET = b"an explicit lane secret, not the environment's"
WRONG = b"another secret of enough bytes, but not that one"
PROMPT = "The lighthouse keeper"


PARSER = build_parser()


def parse(argv: list[str]) -> StageConfig:
    """What ``stagerun stage ARGV`` serves with."""
    return StageConfig.from_args(PARSER.parse_args(["stage", *argv]))


def _seconds(low: float = 1e-3, high: float = 1e5) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


_addresses = st.builds(
    "{}://{}:{}".format,
    st.sampled_from(["tcp", "ws", "tls", "wss"]),
    st.sampled_from(["127.0.0.1", "10.1.2.3", "[::1]", "stage-2.internal"]),
    st.integers(0, 65535),
)
_compute = st.builds(
    StageCompute,
    model=st.sampled_from(["smollm2", "gemma3-270m", "/models/a model.gguf"]),
    layers=st.integers(0, 40).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo + 1, 80))),
    backend=st.sampled_from(["numpy", "torch", "llamacpp"]),
    threads=st.none() | st.integers(1, 64),
    device=st.none() | st.sampled_from(["cpu", "cuda", "cuda:1"]),
    flash_attention=st.none() | st.booleans(),
)
configs = st.builds(
    StageConfig,
    index=st.integers(0, 64),
    compute=_compute,
    downstream=st.none() | st.lists(_addresses, min_size=1, max_size=3).map(",".join),
    listen=_addresses,
    wire_dtype=st.sampled_from(["f32", "f16", "q8"]),
    hop_delay_ms=st.just(0.0) | _seconds(0.0, 1e4),
    bandwidth_mbps=st.none() | _seconds(),
    secret=st.sampled_from([ENV_SECRET, None, SecretFile("/run/stagerun/lane.secret")]),
    handshake_timeout=_seconds(),
    max_batch=st.none() | st.integers(1, 256),
    tick_rows=st.integers(1, 1 << 16),
    inline_compute_ms=st.just(0.0) | _seconds(0.0, 1e3),
    max_sessions=st.integers(1, 1 << 16),
    max_kv_tokens=st.integers(1, 1 << 30),
    max_connections=st.integers(1, 1 << 16),
    max_handshakes=st.integers(1, 1 << 16),
    idle_timeout=_seconds() | st.just(math.inf),
    stall_timeout=_seconds() | st.just(math.inf),
    max_payload_bytes=st.integers(1, 1 << 31),
    max_partial_bytes=st.none() | st.integers(1, 1 << 32),
    insecure=st.booleans(),
    prefix_cache_bytes=st.integers(0, 1 << 14).map(lambda mib: mib << 20),
    reply_timeout=_seconds(),
    downstream_connect_timeout=_seconds(),
    downstream_ready_timeout=_seconds(),
    downstream_retry_window=st.just(0.0) | _seconds(),
)


@settings(deadline=None)  # a shared CPU makes argparse's time vary
@given(configs)
def test_the_command_line_carries_every_setting(config: StageConfig) -> None:
    assert parse(to_argv(config)) == config


@settings(deadline=None)
@given(configs, st.binary(min_size=16, max_size=64))
def test_no_secret_goes_on_a_command_line(config: StageConfig, secret: bytes) -> None:
    with pytest.raises(ValueError, match="cannot go on a command line @ stage"):
        to_argv(config.replace(secret=secret))
    assert "secret=<secret: " in repr(config.replace(secret=secret))
    assert repr(secret) not in repr(config.replace(secret=secret))


def test_the_parser_defaults_are_the_configuration_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STAGERUN_STAGE_REPLY_TIMEOUT_SECS", "7")
    compute = StageCompute(model="smollm2", layers=(2, 4))
    assert parse(["--layers", "2:4"]) == StageConfig(index=1, compute=compute)
    assert StageConfig(index=1).reply_timeout == 7.0
    # the launcher's argv without --listen: the supervisor appends it
    assert "--listen" not in to_argv(StageConfig(index=1, compute=compute), listen=False)


@pytest.mark.parametrize(
    ("field", "value"),
    [("model", ""), ("layers", (3, 3)), ("backend", ""), ("threads", 0), ("flash_attention", "on")],
)
def test_what_a_stage_computes_is_checked_too(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field} .* @ stage compute$"):
        StageCompute(**{"model": "smollm2", "layers": (0, 3), field: value})


def test_every_setting_has_its_check() -> None:
    fields = {field.name for field in attrs.fields(StageConfig)}
    assert set(engine._CHECKS) == fields


INVALID: dict[str, list[Any]] = {
    "index": [-1],
    "compute": ["smollm2"],
    "downstream": ["", "tcp://a:1,,tcp://b:2"],
    "listen": [""],
    "wire_dtype": ["f64"],
    "hop_delay_ms": [-1.0, math.nan, math.inf],
    "bandwidth_mbps": [-5.0, math.inf],
    "secret": [b"short", "a str is not bytes"],
    "handshake_timeout": [0.0, -1.0, math.inf, math.nan],
    "max_batch": [0],
    "tick_rows": [0],
    "inline_compute_ms": [-1.0, math.nan, math.inf],
    "max_sessions": [0],
    "max_kv_tokens": [0],
    "max_connections": [0],
    "max_handshakes": [0],
    "idle_timeout": [0.0, -1.0, math.nan],
    "stall_timeout": [0.0, -1.0, math.nan],
    "max_payload_bytes": [0],
    "max_partial_bytes": [0],
    "insecure": [1, "yes"],
    "prefix_cache_bytes": [-1],
    "reply_timeout": [0.0, math.inf],
    "downstream_connect_timeout": [0.0],
    "downstream_ready_timeout": [-2.0],
    "downstream_retry_window": [-1.0, math.inf],
}


@pytest.mark.parametrize(
    ("name", "value"), [(name, value) for name, values in INVALID.items() for value in values]
)
def test_each_check_refuses_in_one_sentence_naming_the_stage(name: str, value: Any) -> None:
    where = value if name == "index" else 3
    with pytest.raises(ValueError, match=rf"^{name} must be .*, got .* @ stage {where}$"):
        StageConfig(**{"index": 3, name: value})
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        StageConfig(index=3).replace(**{name: value})  # an evolved copy is checked again


def test_invalid_values_cover_every_field() -> None:
    assert set(INVALID) == {field.name for field in attrs.fields(StageConfig)}


def test_the_secret_resolves_where_it_is_used(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, WRONG.decode())
    assert StageConfig(index=1, secret=SecretFile(str(path))).resolve_secret() == SECRET
    assert StageConfig(index=1).resolve_secret() == WRONG
    assert StageConfig(index=1, secret=None).resolve_secret() is None
    assert parse(["--layers", "0:1", "--secret-file", str(path)]).secret == SecretFile(str(path))
    assert parse(["--layers", "0:1", "--no-secret"]).secret is None
    with pytest.raises(ValueError, match="not both"):
        parse(["--layers", "0:1", "--no-secret", "--secret-file", str(path)])


# -- the secret a stage is given is the one it dials with ------------------------------------


@pytest.fixture
def no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


async def _start(nursery: trio.Nursery, backend: NumpyBackend, config: StageConfig) -> str:
    address: str = await nursery.start(serve_stage, backend, config)
    return address


async def test_an_explicit_secret_serves_three_stages_without_the_environment(
    tiny_model: ModelFile, nursery: trio.Nursery, no_env_secret: None
) -> None:
    layout = [(0, 2), (2, 3), (3, 4)]
    last = await _start(
        nursery, NumpyBackend(tiny_model, layout[2]), StageConfig(index=2, secret=SECRET)
    )
    middle = await _start(
        nursery,
        NumpyBackend(tiny_model, layout[1]),
        StageConfig(index=1, downstream=last, secret=SECRET),
    )
    async with LanePool(middle, last_stage=last, secret=SECRET) as pool:
        pipeline = Pipeline(
            tiny_model,
            NumpyBackend(tiny_model, layout[0]),
            [
                StageInfo(0, layout[0], None),
                StageInfo(1, layout[1], middle),
                StageInfo(2, layout[2], last),
            ],
            pool,
            wire_dtype="f32",
        )
        secured = await pipeline.complete(PROMPT, max_tokens=16)
    async with open_pipeline(tiny_model, layers=layout) as plain:
        reference = await plain.complete(PROMPT, max_tokens=16)
    assert_varied(reference.token_ids)
    assert secured.token_ids == reference.token_ids


async def test_a_wrong_secret_downstream_is_refused(
    tiny_model: ModelFile, nursery: trio.Nursery, no_env_secret: None
) -> None:
    last = StageServer(NumpyBackend(tiny_model, (3, 4)), index=2, secret=SECRET)
    address = await nursery.start(last.serve)
    wrong = StageServer(
        NumpyBackend(tiny_model, (2, 3)),
        index=1,
        downstream=address,
        secret=WRONG,
        downstream_retry_window=0.0,
    )
    with trio.fail_after(5), pytest.raises(LaneHandshakeError, match="lane secret"):
        await connect_downstream(wrong.config)
    with trio.fail_after(5):
        while last.refused < 1:  # noqa: ASYNC110 -- a counter, no event to wait on
            await trio.sleep(0.01)
    right = wrong.config.replace(secret=SECRET)
    with trio.fail_after(5):
        hop = await connect_downstream(right)
    await hop.aclose_forcefully()
    assert last.refused == 1
