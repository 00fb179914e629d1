"""`PipelineConfig` and `plan`: the pipeline's settings checked and laid out without a socket."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import attrs
import pytest

import stagerun
from stagerun import PipelineConfig, plan
from stagerun._cli._config import config_from_args
from stagerun._cli._options import build_parser
from stagerun._driver._config import stage_config
from stagerun.plugins import PluginError
from stagerun.testing import write_tiny_model


def test_the_defaults_are_one_stage_in_process() -> None:
    layout = plan(PipelineConfig(), 30)
    assert layout.ranges == [(0, 30)]
    assert [s.backend for s in layout.stages] == ["ggml"]  # "auto": ggml runs here


def test_stages_split_evenly_and_listen_where_their_transport_says() -> None:
    layout = plan(PipelineConfig(stages=3, transports=("ws", "tcp")), 30)
    assert layout.ranges == [(0, 10), (10, 20), (20, 30)]
    assert [s.listen for s in layout.stages] == [None, "ws://127.0.0.1:0", "tcp://127.0.0.1:0"]
    assert [s.remote for s in layout.stages] == [None, None, None]


def test_remote_stages_are_joined_not_started() -> None:
    layout = plan(PipelineConfig(remote=["tcp://10.1.1.1:9001", "tcp://10.1.1.2:9002"]), 30)
    assert layout.ranges == [(0, 10), (10, 20), (20, 30)]
    assert [s.remote for s in layout.stages] == [None, "tcp://10.1.1.1:9001", "tcp://10.1.1.2:9002"]
    assert {s.listen for s in layout.stages} == {None}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (PipelineConfig(layers=[(0, 10), (12, 30)]), "must be contiguous"),
        (PipelineConfig(layers=[(0, 10), (10, 20)]), "must end at the model's 30 layers"),
        (PipelineConfig(stages=31), "cannot split 30 layers into 31 stages"),
        (PipelineConfig(stages=3, transports=("ws",)), "3 stages have 2 hops, but 1 transports"),
        (PipelineConfig(stages=2, backends=("numpy",)), "2 stages need 2 backends, got 1"),
        (
            PipelineConfig(layers=[(0, 10), (10, 30)], remote=["a:1", "b:2"]),
            "2 stages need 1 remote addresses, got 2",
        ),
        (PipelineConfig(device="cuda"), "--device cuda needs a backend with a device"),
        (
            PipelineConfig(backend="numpy", flash_attention=False),
            "--flash-attention needs a backend that takes it",
        ),
        (PipelineConfig(hop_delay_ms=-1), "hop_delay_ms must not be negative"),
    ],
)
def test_contradictions_are_refused_before_anything_starts(
    config: PipelineConfig, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan(config, 30)


# One invalid value per PipelineConfig field; a new field fails the test below until it has one.
INVALID: dict[str, Any] = {
    "stages": 0,
    "layers": [(0, 10), (12, 30)],
    "mode": "threads",
    "remote": [""],
    "host": "",
    "threads": 0,
    "stage_threads": (0,),
    "wire_dtype": "f8",
    "capacity": 0,
    "prefill_chunk": "huge",
    "prefill_credit": 0,
    "hop_delay_ms": -1.0,
    "bandwidth_mbps": -1.0,
    "speculation": "ngram",
    "transport": "pigeon",
    "transports": ("tcp",),
    "backend": "abacus",
    "backends": ("numpy", "numpy"),
    "device": "cuda",
    "flash_attention": "yes",
    "recovery": stagerun.RecoveryPolicy(max_breaks=-1),
    "supervision": stagerun.SupervisionPolicy(probe_timeout=0),
    "reply_timeout": 0.0,
    "prefix_cache": "yes",
    "prefix_cache_mb": -1,
    "chat_template": "  ",
    "inline_compute_ms": -1.0,
}


def test_every_setting_has_an_invalid_value_here() -> None:
    assert set(INVALID) == set(attrs.fields_dict(PipelineConfig))


@pytest.mark.parametrize("name", sorted(INVALID))
def test_plan_refuses_every_invalid_setting(name: str) -> None:
    plan(PipelineConfig(), 30)  # the defaults pass, so the one setting is what is refused
    with pytest.raises((ValueError, PluginError)) as refused:
        plan(PipelineConfig(**{name: INVALID[name]}), 30)
    message = str(refused.value)
    assert "\n" not in message
    if isinstance(refused.value, ValueError) and "@ PipelineConfig." in message:
        assert message.endswith(f"@ PipelineConfig.{name}")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("prefill_chunk", 0, "prefill_chunk must be"),
        ("prefill_credit", 0, "prefill_credit must be at least 1"),
        ("capacity", 0, "capacity must be at least 1"),
        ("wire_dtype", "bf16", "wire_dtype must be one of f32, f16, q8"),
        ("reply_timeout", -1.0, "reply_timeout must be None or a positive number"),
    ],
)
def test_what_open_pipeline_refused_late_plan_refuses_first(
    name: str, value: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan(PipelineConfig(stages=3, **{name: value}), 30)


def test_the_stages_started_here_get_their_configuration_from_the_plan() -> None:
    config = PipelineConfig(stages=3, capacity=32, wire_dtype="q8", hop_delay_ms=5.0)
    layout = plan(config, 30)
    middle = stage_config(config, layout.stages[1], downstream="tcp://127.0.0.1:9", model="m")
    assert (middle.index, middle.listen, middle.downstream) == (
        1,
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:9",
    )
    assert (middle.wire_dtype, middle.link.delay_s, middle.max_sessions) == ("q8", 0.005, 128)
    assert middle.compute is not None and middle.compute.layers == (10, 20)
    assert stage_config(config, layout.stages[2], downstream=None).compute is None


def test_an_unknown_plugin_is_refused_by_the_plan() -> None:
    with pytest.raises(PluginError, match="nosuch"):
        plan(PipelineConfig(stages=2, backend="nosuch"), 30)


def test_replace_takes_field_names_only() -> None:
    config = PipelineConfig().replace(stages=3, capacity=2)
    assert (config.stages, config.capacity) == (3, 2)
    with pytest.raises(TypeError, match="no setting 'stage'"):
        PipelineConfig().replace(stage=3)
    assert PipelineConfig(layers=[[0, 5], [5, 9]]).layers == ((0, 5), (5, 9))


async def test_open_pipeline_refuses_a_keyword_that_names_no_setting() -> None:
    with pytest.raises(TypeError, match="no setting 'stagez'"):
        async with stagerun.open_pipeline("smollm2", stagez=3):
            raise AssertionError("started anyway")


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_generate_serve_and_bench_map_the_same_options_to_the_same_settings() -> None:
    shared = [
        "--threads", "2", "--wire-dtype", "f16", "--transports", "ws,tcp",
        "--backends", "numpy,numpy,numpy", "--hop-delay-ms", "5",
    ]  # fmt: skip
    generate = config_from_args(_args("generate", "--stages", "3", *shared, "hi"))
    serve = config_from_args(_args("serve", "--stages", "3", *shared))
    bench = config_from_args(
        _args("bench", "speculative", "--stages", "3", *shared), speculation=None
    )
    for config in (generate, serve, bench):
        assert (config.threads, config.wire_dtype, config.transports) == (2, "f16", ("ws", "tcp"))
        assert (config.backends, config.hop_delay_ms, config.stages) == (("numpy",) * 3, 5.0, 3)
    assert serve.capacity == 16  # --max-batch's default: a lane for each
    assert generate.mode == serve.mode == "processes"


def test_stage_threads_give_each_stage_its_own_thread_count() -> None:
    layout = plan(PipelineConfig(stages=3, threads=4, stage_threads=(2, 1, 1)), 30)
    assert [s.threads for s in layout.stages] == [2, 1, 1]
    assert [s.threads for s in plan(PipelineConfig(stages=3, threads=4), 30).stages] == [4, 4, 4]
    with pytest.raises(ValueError, match="3 stages need 3 thread counts of at least 1, got 2, 1"):
        plan(PipelineConfig(stages=3, stage_threads=(2, 1)), 30)
    for command in (["generate", "x"], ["serve"], ["bench", "decode"]):
        args = _args(*command, "--stage-threads", "2,1,1")
        assert config_from_args(args).stage_threads == (2, 1, 1)
    with pytest.raises(SystemExit):
        _args("generate", "--stage-threads", "2,0", "x")


async def test_flash_attention_reaches_the_ggml_stages_and_only_them(
    tmp_path: pathlib.Path,
) -> None:
    """``--flash-attention off`` on the command line: a setting of the plan's ggml stages, on
    the command line of each stage process, and in the backend stage 0 builds."""
    for command in (["generate", "x"], ["serve"], ["bench", "decode"]):
        off = config_from_args(_args(*command, "--flash-attention", "off"))
        assert off.flash_attention is False
        assert config_from_args(_args(*command)).flash_attention is None
    with pytest.raises(SystemExit):
        _args("serve", "--flash-attention", "maybe")
    config = PipelineConfig(stages=3, backends=("ggml", "numpy", "ggml"), flash_attention=False)
    assert [s.flash_attention for s in plan(config, 30).stages] == [False, None, False]
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=3)
    async with stagerun.open_pipeline(model, backend="ggml", flash_attention=False) as pipeline:
        await pipeline.complete("hello", max_tokens=2)
        assert pipeline.engine.backend._ops.flash is False
    async with stagerun.open_pipeline(model, backend="ggml") as pipeline:
        assert pipeline.engine.backend._ops.flash is True


async def test_stage_threads_reach_the_backends(tmp_path: pathlib.Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=3)
    config = PipelineConfig(stages=3, stage_threads=(3, 1, 2))
    async with stagerun.open_pipeline(model, config) as pipeline:
        await pipeline.complete("hello", max_tokens=2)
        assert pipeline.engine.backend.threads == 3
    assert [s.threads for s in plan(config, 3).stages] == [3, 1, 2]


def test_chat_template_files_are_read_bounded_and_reach_the_config(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stagerun._cli._pipeline_options import MAX_TEMPLATE_BYTES

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    for command in (["serve"], ["generate", "hi"], ["bench", "decode"]):
        args = build_parser().parse_args([*command, "--chat-template", str(template)])
        assert config_from_args(args).chat_template == "{{ messages[0]['content'] }}"
    assert config_from_args(build_parser().parse_args(["serve"])).chat_template is None
    (tmp_path / "big.jinja").write_text("x" * (MAX_TEMPLATE_BYTES + 1))
    (tmp_path / "empty.jinja").write_text("  \n")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe")
    for name, words in [
        ("big.jinja", f"is over {MAX_TEMPLATE_BYTES} characters"),
        ("empty.jinja", "is empty"),
        ("binary.jinja", "is not UTF-8 text"),
        ("missing.jinja", "cannot read the chat template"),
    ]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--chat-template", str(tmp_path / name)])
        assert words in capsys.readouterr().err


def test_layer_ranges_take_the_cli_forms_and_bad_ones_raise_layer_range_error() -> None:
    from stagerun import LayerRangeError

    pairs = ((0, 15), (15, 30))
    assert PipelineConfig(layers=["0:15", "15:30"]).layers == pairs
    assert PipelineConfig(layers="0:15,15:30").layers == pairs
    assert PipelineConfig(layers=[[0, 15], (15, 30)]).layers == pairs
    for bad in (["0-15"], [(0, "a")], [(1, 2, 3)], [(True, 3)]):
        with pytest.raises(LayerRangeError, match=r"PipelineConfig\.layers"):
            PipelineConfig(layers=bad)
    for config in (PipelineConfig(layers=[(0, 10), (12, 30)]), PipelineConfig(stages=40),
                   PipelineConfig(layers=[(0, 29)])):  # fmt: skip
        with pytest.raises(LayerRangeError):
            plan(config, 30)
