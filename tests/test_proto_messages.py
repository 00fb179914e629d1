"""Message values: validation on construction, the wire converter, and the package's shape."""

import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import msgpack
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import stagerun._proto as proto
from stagerun._errors import ProtocolError
from stagerun._proto import (
    CARRIES_ACTIVATIONS,
    MAX_ERROR_MESSAGE,
    MAX_PREFIX_NAMES,
    MAX_STATUS_SPANS,
    MAX_TOKENS_PER_MESSAGE,
    MAX_WINDOW_IDS,
    MESSAGE_TYPES,
    Ack,
    Cancel,
    Cancelled,
    Configure,
    Decode,
    Error,
    Predictions,
    Prefill,
    PrefixStats,
    Probe,
    Remember,
    SamplingParams,
    StageStats,
    Status,
    Stop,
    Trim,
    Verify,
)
from stagerun._proto._messages import structure_message, unstructure_message

PUBLIC_NAMES = [
    "PROTOCOL_VERSION",
    "NEED_DATA",
    "Configure",
    "Prefill",
    "Decode",
    "Verify",
    "Cancel",
    "Trim",
    "Stop",
    "Ack",
    "Predictions",
    "Error",
    "Message",
    "SamplingParams",
    "StageStats",
    "CARRIES_ACTIVATIONS",
    "Frame",
    "FrameDecoder",
    "encode_frame",
    "encode_activations",
    "decode_activations",
    "activation_nbytes",
    "ActivationDType",
    "Role",
    "Hello",
    "Ready",
    "Refused",
    "HELLO_SIZE",
    "encode_hello",
    "decode_hello",
    "encode_ready",
    "encode_refusal",
    "ReadyDecoder",
    "MAX_TOKENS_PER_MESSAGE",
    "MAX_WINDOW_IDS",
    "MAX_ERROR_MESSAGE",
    "MAX_HEADER_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_ACTIVATION_COLS",
]


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_public_names_are_exported(name: str) -> None:
    assert hasattr(proto, name)


def test_protocol_core_never_imports_trio() -> None:
    # stagerun/__init__ pulls in the Trio runtime, so register a bare package shell for
    # "stagerun" and import only the protocol core (and what it imports) into a fresh process.
    package_dir = Path(proto.__file__).resolve().parents[1]
    code = textwrap.dedent(
        """
        import sys, types
        shell = types.ModuleType("stagerun")
        shell.__path__ = [sys.argv[1]]
        sys.modules["stagerun"] = shell
        import stagerun._proto
        assert "trio" not in sys.modules, "stagerun._proto imported trio"
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(package_dir)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_kinds_and_activation_carriers() -> None:
    assert list(MESSAGE_TYPES) == [
        "configure", "prefill", "decode", "verify", "cancel", "trim", "remember",
        "probe", "stop", "ack", "predictions", "cancelled", "error", "status",
    ]  # fmt: skip
    assert all(cls.kind == kind for kind, cls in MESSAGE_TYPES.items())
    assert {Prefill, Decode, Verify} == CARRIES_ACTIVATIONS


def test_stage_stats_merge_sums_every_field() -> None:
    a = StageStats(1, 2, 3, 4, 5)
    b = StageStats(10, 20, 30, 40, 50)
    assert a.merge(b) == StageStats(11, 22, 33, 44, 55)
    assert a.merge(StageStats()) == a
    assert StageStats().merge(StageStats()) == StageStats(0, 0, 0, 0, 0)


def test_sampling_params_defaults_and_int_floats() -> None:
    assert SamplingParams() == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    params = SamplingParams(temperature=1, top_p=1, seed=2**64 - 1)
    assert type(params.temperature) is float and type(params.top_p) is float


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"temperature": math.nan}, "temperature must be a finite float, got nan"),
        ({"temperature": math.inf}, "finite float"),
        ({"temperature": "1"}, "finite float, got '1'"),
        ({"temperature": True}, "finite float, got True"),
        ({"top_k": -1}, r"top_k must be an int in \[0, 2\*\*63\), got -1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "got 1.5"),
        ({"seed": 2**64}, r"seed must be an int in \[0, 2\*\*64\)"),
        ({"seed": -1}, "seed"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"min_p": math.nan}, "min_p must be a finite float"),
        ({"bias_ids": (1, 2), "bias_values": (1.0,)}, "a tuple of 2 floats, one per bias id"),
        ({"bias_ids": (1,), "bias_values": (101.0,)}, r"floats in \[-100, 100\], got 101.0"),
        ({"bias_ids": (1,), "bias_values": (True,)}, r"in \[-100, 100\], got True"),
        ({"bias_ids": (1, 1), "bias_values": (1.0, 2.0)}, "must not repeat a token"),
        ({"bias_ids": (-1,), "bias_values": (1.0,)}, "bias_ids"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Decode(1, 0, ()), "Decode.tokens must not be empty"),
        (lambda: Prefill(1, 0, 0, [], True), "Prefill.tokens must not be empty"),
        (lambda: Verify(1, 0, 0, 0, ()), "Verify.tokens must not be empty"),
        (lambda: Decode(1, 0, (2**31,)), r"Decode.tokens\[0\] must be an int in \[0, 2\*\*31\)"),
        (lambda: Decode(1, 0, (1, -1)), r"tokens\[1\].*got -1"),
        (lambda: Decode(1, 0, (1, True)), r"tokens\[1\].*got True"),
        (lambda: Decode(1, 0, (1.0,)), r"tokens\[0\].*got 1.0"),  # type: ignore[arg-type]
        (lambda: Decode(1, 0, "ab"), "tuple of ints, got 'ab'"),  # type: ignore[arg-type]
        (lambda: Decode(1, 0, (0,) * (MAX_TOKENS_PER_MESSAGE + 1)), "limit of 65536"),
        (lambda: Decode(-1, 0, (1,)), "Decode.request_id"),
        (lambda: Decode(1, 2**63, (1,)), "Decode.position"),
        (lambda: Decode(1, "5", (1,)), "got '5'"),  # type: ignore[arg-type]
        (lambda: Prefill(1, 0, 0, (1,), 1), "Prefill.predict must be a bool, got 1"),  # type: ignore[arg-type]
        (lambda: Configure(1, 2**64, 0), "return_key must be an int in \\[0, 2\\*\\*64\\)"),
        (lambda: Configure(1, 0, -1), "prompt_len"),
        (lambda: Cancel(1, 0, (0,) * (MAX_WINDOW_IDS + 1)), "holds 65 items, more than the limit"),
        (lambda: Cancel(1, 0, (2**63,)), r"window_ids\[0\]"),
        (lambda: Trim(1, -3), "Trim.position"),
        (lambda: Stop(None), "Stop.request_id"),  # type: ignore[arg-type]
        (lambda: Error(1, 0, "x" * (MAX_ERROR_MESSAGE + 1)), "4097 characters long"),
        (lambda: Error(1, 0, b"bytes"), "must be a str"),  # type: ignore[arg-type]
        (lambda: Predictions(1, 0, 0, (1,), stats=None), "stats"),  # type: ignore[arg-type]
    ],
)
def test_invalid_messages_cannot_be_built(build: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_token_sequences_are_normalised_to_tuples_of_ints() -> None:
    assert Decode(1, 0, [5, 6]).tokens == (5, 6)
    from_numpy = Decode(1, 0, np.array([5, 6], dtype=np.int64))
    assert from_numpy.tokens == (5, 6) and all(type(t) is int for t in from_numpy.tokens)
    assert Decode(1, 0, tuple(np.array([7], dtype=np.int32))).tokens == (7,)
    assert Cancel(1, 2, [3, 4]).window_ids == (3, 4)
    assert Predictions(1, 0, 0, ()).tokens == ()  # predictions may be empty
    assert Decode(1, 0, (1,)) == Decode(1, 0, [1])  # and so compare and hash equal
    assert hash(Decode(1, 0, (1,))) == hash(Decode(1, 0, [1]))


def test_stats_merge_sums_totals_and_keeps_the_slowest_stage_and_edge() -> None:
    fast = StageStats(compute_us=100, stage_count=1, token_count=100, slowest_compute_us=100,
                      slowest_tokens=100, slowest_stage=1, edge_write_us=5, edge_wait_us=50,
                      edge_stage=1)  # fmt: skip
    slow = StageStats(compute_us=300, stage_count=1, token_count=100, slowest_compute_us=300,
                      slowest_tokens=100, slowest_stage=2)  # fmt: skip
    merged = fast.merge(slow)
    assert (merged.compute_us, merged.stage_count, merged.token_count) == (400, 2, 200)
    assert (merged.slowest_compute_us, merged.slowest_stage) == (300, 2)
    assert (merged.edge_wait_us, merged.edge_stage) == (50, 1)
    assert slow.merge(fast) == merged


def test_unstructure_gives_plain_msgpack_values() -> None:
    message = Predictions(1, 2, 3, (4, 5), StageStats(compute_us=9))
    assert unstructure_message(message) == {
        "request_id": 1,
        "window_id": 2,
        "position": 3,
        "tokens": [4, 5],
        "stats": {
            "compute_us": 9,
            "forward_write_us": 0,
            "downstream_wait_us": 0,
            "stage_count": 0,
            "token_count": 0,
            "slowest_compute_us": 0,
            "slowest_tokens": 0,
            "slowest_stage": 0,
            "edge_write_us": 0,
            "edge_wait_us": 0,
            "edge_stage": 0,
        },
        "logprobs": [],
        "top_ids": [],
        "top_logprobs": [],
        "prompt_logprobs": [],
        "prompt_top_ids": [],
        "prompt_top_logprobs": [],
    }
    rows = Predictions(1, 2, 3, (4, 5), logprobs=(-0.5, -1.0), top_ids=(4, 8, 5, 9),
                       top_logprobs=(-0.5, -2.0, -1.0, -1.5))  # fmt: skip
    assert structure_message("predictions", unstructure_message(rows)) == rows
    configure = Configure(1, 2, 3, SamplingParams(0.7, 40, 0.9, 5, 0.05, (7, 9), (-100, 2.5)))
    assert structure_message("configure", unstructure_message(configure)) == configure


@pytest.mark.parametrize(
    ("kind", "fields", "match"),
    [
        ("nope", {}, "unknown message kind 'nope'; expected one of configure, prefill"),
        (None, {}, "unknown message kind None"),
        (["decode"], {}, "unknown message kind"),
        ("trim", {"request_id": 1}, "bad trim message: Trim is missing field 'position'"),
        ("stop", {"request_id": 1, "extra": 2}, "Stop has unknown field 'extra'"),
        ("stop", {"request_id": 1, b"x": 2}, "unknown field b'x'"),
        ("stop", None, "Stop fields must be a map, got None"),
        (
            "ack",
            {"request_id": 1, "stats": [0, 0, 0, 0, 0], "cached": 0},
            "StageStats fields must be a map",
        ),
        (
            "ack",
            {"request_id": 1, "stats": {"compute_us": 1}, "cached": 0},
            "StageStats is missing field",
        ),
        ("ack", {"request_id": 1, "stats": {}}, "Ack is missing field 'cached'"),
        ("remember", {"request_id": 1, "prefix": [1, -2]}, r"Remember.prefix\[1\]"),
        ("trim", {"request_id": 1, "position": 2.0}, "Trim.position must be an int"),
        ("cancel", {"request_id": 1, "epoch": 0, "window_ids": [1, "2"]}, r"window_ids\[1\]"),
    ],
)
def test_structure_message_errors_are_protocol_errors(kind: Any, fields: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        structure_message(kind, fields)


# --- the round trip, on messages that are valid by construction -----------------------------
#
# Every field is drawn from its valid range (limits included), so every example reaches the
# round trip; drawing arbitrary maps instead (the fuzz test further down) almost never builds a
# valid message, and a round-trip assertion behind a ``try`` would then not run at all.

ids = st.integers(0, 2**63 - 1)
keys = st.integers(0, 2**64 - 1)
token_ids = st.integers(0, 2**31 - 1)
tokens = st.lists(token_ids, min_size=1, max_size=8).map(tuple) | st.just(
    (2**31 - 1,) * MAX_TOKENS_PER_MESSAGE
)
maybe_tokens = st.just(()) | tokens
window_ids = st.lists(ids, max_size=MAX_WINDOW_IDS).map(tuple)
stats = st.builds(StageStats, *[ids] * len(attrs.fields(StageStats)))
names = st.lists(keys, max_size=8).map(tuple) | st.just((2**64 - 1,) * MAX_PREFIX_NAMES)
prefix_stats = st.builds(PrefixStats, st.booleans(), *[ids] * (len(attrs.fields(PrefixStats)) - 1))
biases = st.dictionaries(st.integers(0, 2**31 - 1), st.floats(-100, 100) | st.integers(-100, 100),
                         max_size=8)  # fmt: skip
sampling = st.builds(
    lambda bias, **kwargs: SamplingParams(
        **kwargs, bias_ids=tuple(bias), bias_values=tuple(bias.values())
    ),
    biases,
    temperature=st.floats(0, 1e6) | st.integers(0, 100),  # an int is stored as a float
    top_k=ids,
    top_p=st.floats(0, 1, exclude_min=True),
    seed=keys,
    min_p=st.floats(0, 1) | st.just(1),
)
# a Status's spans: start, end after it, window, kind, batch; flattened
half = st.integers(0, 2**62 - 1)  # a start and a length that fit together
spans = st.lists(
    st.tuples(half, half, ids, st.integers(0, 1), ids).map(lambda s: (s[0], s[0] + s[1], *s[2:])),
    max_size=MAX_STATUS_SPANS,
).map(lambda rows: tuple(v for row in rows for v in row))
error_text = st.text(max_size=40) | st.just("é" * MAX_ERROR_MESSAGE)

VALID_MESSAGES: dict[str, st.SearchStrategy[Any]] = {
    "configure": st.builds(Configure, ids, keys, ids, sampling, names),
    "prefill": st.builds(Prefill, ids, ids, ids, tokens, st.booleans()),
    "decode": st.builds(Decode, ids, ids, tokens),
    "verify": st.builds(Verify, ids, ids, ids, ids, tokens),
    "cancel": st.builds(Cancel, ids, ids, window_ids),
    "trim": st.builds(Trim, ids, ids),
    "remember": st.builds(Remember, ids, names),
    "probe": st.builds(Probe, ids),
    "stop": st.builds(Stop, ids),
    "ack": st.builds(Ack, ids, stats, ids),
    "predictions": st.builds(Predictions, ids, ids, ids, maybe_tokens, stats),
    "cancelled": st.builds(Cancelled, ids, ids, window_ids),
    "error": st.builds(Error, ids, ids, error_text),
    "status": st.builds(Status, ids, ids, prefix_stats, ids, ids, ids, ids, spans),
}


def over_the_wire(message: Any) -> Any:
    """Unstructure, pack, unpack (as `FrameDecoder` does) and structure ``message`` again."""
    header = msgpack.packb({"kind": message.kind, "fields": unstructure_message(message)})
    unpacked = msgpack.unpackb(header, raw=False, use_list=False, strict_map_key=True)
    return structure_message(unpacked["kind"], unpacked["fields"])


def test_every_kind_has_a_valid_message_strategy() -> None:
    assert VALID_MESSAGES.keys() == MESSAGE_TYPES.keys()


@pytest.mark.parametrize("kind", list(MESSAGE_TYPES))
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_every_valid_message_survives_the_wire(kind: str, data: st.DataObject) -> None:
    message = data.draw(VALID_MESSAGES[kind], label="message")
    assert type(message) is MESSAGE_TYPES[kind]
    event(f"round trip of a {kind} message")  # --hypothesis-show-statistics: one per example
    assert structure_message(kind, unstructure_message(message)) == message
    again = over_the_wire(message)
    assert again == message
    assert unstructure_message(again) == unstructure_message(message)  # same types, not just ==


# Values no field accepts: not an int in range, not a tuple of token or window ids, not a bool,
# not a str, not a map with the nested class's fields, and not a finite float >= 0.
NEVER_VALID: list[object] = [None, b"x", -3, math.nan, (None,), {}]  # penalties take -2..2


def corrupt(message: Any, data: st.DataObject) -> tuple[dict[str, Any], str]:
    """Break one thing in the wire form of ``message``; return it and what the error names."""
    fields = unstructure_message(message)
    how = data.draw(st.sampled_from(["replace", "drop", "add"]), label="how")
    if how == "add":
        fields["extra"] = data.draw(st.sampled_from([0, "x", None]), label="extra value")
        return fields, "unknown field 'extra'"
    name = data.draw(st.sampled_from(sorted(fields)), label="field")
    if how == "drop":
        del fields[name]
        return fields, f"missing field {name!r}"
    bad = data.draw(st.sampled_from(NEVER_VALID), label="bad value")
    if type(fields[name]) is not dict:
        fields[name] = bad
        return fields, f"{type(message).__name__}.{name}"
    nested = type(getattr(message, name)).__name__  # SamplingParams or StageStats
    if data.draw(st.booleans(), label="inside the nested map"):
        inner = data.draw(st.sampled_from(sorted(fields[name])), label="inner field")
        fields[name] = {**fields[name], inner: bad}
        return fields, f"{nested}.{inner}"
    fields[name] = bad
    return fields, nested


@pytest.mark.parametrize("kind", list(MESSAGE_TYPES))
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_a_valid_message_with_one_field_broken_is_a_protocol_error(
    kind: str, data: st.DataObject
) -> None:
    message = data.draw(VALID_MESSAGES[kind], label="message")
    fields, culprit = corrupt(message, data)
    with pytest.raises(ProtocolError, match=f"^bad {kind} message: ") as caught:
        structure_message(kind, fields)
    assert culprit in str(caught.value)


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=3).map(tuple)
        | st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
names = st.sampled_from(
    sorted({field.name for cls in MESSAGE_TYPES.values() for field in attrs.fields(cls)} | {"x"})
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(MESSAGE_TYPES)), st.dictionaries(names, values, max_size=7))
def test_structuring_arbitrary_fields_raises_only_protocol_error(
    kind: str, fields: dict[str, Any]
) -> None:
    """Hostile input: nearly every example is invalid; the only error allowed is ProtocolError.

    (The round trip is tested above, on messages valid by construction.)
    """
    try:
        structure_message(kind, fields)
    except ProtocolError:
        event("protocol error")
    else:
        event("valid by chance")


def test_messages_are_frozen() -> None:
    message = Decode(1, 0, (1,))
    with pytest.raises(AttributeError):
        message.position = 3  # type: ignore[misc]
    assert Ack(1).stats == StageStats()
