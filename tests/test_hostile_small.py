"""Small hostile inputs: lane secret files, crafted GGUF headers, plugin names, huge headers, q8.

Each test is an attack (or a mistake an operator makes) that used to cost time, memory or a
silent downgrade; each stays under a second.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgpack
import numpy as np
import pytest

from stagerun import plugins
from stagerun._errors import ModelError, ProtocolError
from stagerun._proto import Frame, FrameDecoder, Prefill, Stop, encode_frame
from stagerun._proto._messages import unstructure_message
from stagerun._wire import _auth
from stagerun._wire._auth import SECRET_FILE_ENV, lane_secret
from stagerun.drafters import NgramDrafter
from stagerun.model import open_model
from stagerun.model._gguf import MAX_GGUF_ARRAY_ITEMS, check_gguf_header
from stagerun.transports import TcpTransport

SECRET = b"correct horse battery staple 42"

# -- a. the lane secret file ------------------------------------------------------------------


def _secret_file(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "lane.secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602, 0o620], ids=oct)
def test_a_secret_file_other_users_can_read_or_change_is_refused(tmp_path: Path, mode: int) -> None:
    path = _secret_file(tmp_path, mode)
    with pytest.raises(
        ValueError, match=rf"has mode {mode:04o}.*chmod 600 {re.escape(str(path))}$"
    ):
        lane_secret({SECRET_FILE_ENV: str(path)})


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=oct)
def test_a_private_secret_file_is_accepted(tmp_path: Path, mode: int) -> None:
    path = _secret_file(tmp_path, mode)
    assert lane_secret({SECRET_FILE_ENV: str(path)}) == SECRET


def test_a_secret_file_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _secret_file(tmp_path, 0o600)
    owner = path.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(ValueError, match=rf"belongs to uid {owner}, not to this user"):
        lane_secret({SECRET_FILE_ENV: str(path)})


def test_the_secret_file_is_read_once_and_again_only_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _secret_file(tmp_path, 0o600)
    env = {SECRET_FILE_ENV: str(path)}
    opened: list[str] = []

    def counting_open(file: str, mode: str) -> IO[Any]:
        opened.append(file)
        return open(file, mode)

    monkeypatch.setattr(_auth, "open", counting_open, raising=False)
    for _ in range(100):  # a hundred lanes dialled
        assert lane_secret(env) == SECRET
    assert opened == [str(path)]
    # A rotated secret (a new file moved into place) is picked up.
    new = tmp_path / "new.secret"
    new.write_bytes(b"a brand new lane secret of 32 b")
    new.chmod(0o600)
    new.replace(path)
    assert lane_secret(env) == b"a brand new lane secret of 32 b"
    assert len(opened) == 2
    # A chmod after the first read is noticed although the contents are cached.
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        lane_secret(env)


def test_an_endless_secret_file_is_refused(tmp_path: Path) -> None:
    path = _secret_file(tmp_path, 0o600)
    path.write_bytes(b"x" * (_auth.MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="holds more than 65536 bytes"):
        lane_secret({SECRET_FILE_ENV: str(path)})


# -- b. crafted GGUF headers ------------------------------------------------------------------

U8, STRING, ARRAY = 0, 8, 9


def _str(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _gguf(kvs: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors


def _array(key: bytes, item_type: int, count: int, items: bytes = b"") -> bytes:
    return _str(key) + struct.pack("<IIQ", ARRAY, item_type, count) + items


def _tensor(name: bytes, dims: list[int], qtype: int = 0, offset: int = 0) -> bytes:
    n = struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
    return _str(name) + n + struct.pack("<IQ", qtype, offset)


CRAFTED = {
    # the review's file: 49 bytes announcing 4M array items (27 s and 3.8 GiB before)
    "a 4M-item array in 49 bytes": (
        _gguf(_array(b"a", U8, 4_000_000), 1),
        r"the length of 'a' is 4000000, but the rest of the file holds at most 0",
    ),
    "a 4M-string array": (
        _gguf(_array(b"tokenizer.ggml.tokens", STRING, 4_000_000, _str(b"x") * 4), 1),
        r"is 4000000, but the rest of the file holds at most 4",
    ),
    "an array over the item limit": (
        _gguf(_array(b"big", U8, MAX_GGUF_ARRAY_ITEMS + 1, bytes(MAX_GGUF_ARRAY_ITEMS + 1)), 1),
        rf"is {MAX_GGUF_ARRAY_ITEMS + 1}, more than the limit of {MAX_GGUF_ARRAY_ITEMS}",
    ),
    "arrays over the total item limit": (
        _gguf(b"".join(_array(b"k%d" % i, U8, 1 << 19, bytes(1 << 19)) for i in range(5)), n_kv=5),
        r"the metadata arrays hold more than 2097152 items \(at 'k4'\)",
    ),
    "a 2**40-byte string": (
        _gguf(_str(b"general.name") + struct.pack("<IQ", STRING, 1 << 40), 1),
        r"the length of 'general.name' is 1099511627776, but the rest of the file holds at most",
    ),
    "2**60 keys": (_gguf(n_kv=1 << 60), "the metadata key count is 1152921504606846976"),
    "2**40 tensors": (_gguf(n_tensors=1 << 40), "the tensor count is 1099511627776"),
    "a 2**40-byte key": (
        b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 40) + bytes(16),
        "the length of a metadata key is 1099511627776",
    ),
    "arrays nested three deep": (
        _gguf(_array(b"n", ARRAY, 1, struct.pack("<IQ", ARRAY, 1) * 2 + bytes(16)), 1),
        "nests arrays deeper than 2",
    ),
    "an unknown value type": (
        _gguf(_str(b"k") + struct.pack("<I", 99) + bytes(8), 1),
        "'k' has the unknown value type 99",
    ),
    "a tensor of 4 billion dimensions": (
        _gguf(tensors=_str(b"t") + struct.pack("<I", 0xFFFFFFFF) + bytes(40), n_tensors=1),
        "tensor 't' has 4294967295 dimensions, not 1 to 4",
    ),
    "a tensor larger than the file": (
        _gguf(tensors=_tensor(b"token_embd.weight", [1 << 20, 1 << 20]), n_tensors=1),
        r"tensor 'token_embd.weight' of shape \[1048576, 1048576\] needs 4398046511104 bytes",
    ),
    "a truncated header": (_gguf()[:20], "the metadata key count needs 8 bytes at offset 16"),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_gguf_headers_are_refused_at_once(tmp_path: Path, name: str) -> None:
    data, problem = CRAFTED[name]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(ModelError, match=problem) as excinfo:
        open_model(path)
    assert time.perf_counter() - start < 1.0
    assert str(excinfo.value).startswith(f"{path} is not a usable GGUF file: ")


def test_real_headers_pass_the_check(tiny_model_path: Path) -> None:
    check_gguf_header(tiny_model_path)
    assert open_model(tiny_model_path).config.n_layers == 4


# -- c. plugins: names compared one way, built-ins never taken away ---------------------------

PLUGIN_MODULE = """
import trio
from stagerun.abc import Drafter, Transport


class Impostor(Transport):
    schemes = ("tcp",)

    async def connect(self, address, *, timeout):
        raise NotImplementedError

    async def serve(self, address, handler, *, task_status=trio.TASK_STATUS_IGNORED):
        raise NotImplementedError


class Proposer(Drafter):
    def begin(self, prompt):
        pass

    def commit(self, tokens):
        pass

    def propose(self, context, max_tokens):
        return [7]
"""


def _distribution(root: Path, name: str, entry_points: str) -> None:
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def hostile_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "hostile_small_mod.py").write_text(PLUGIN_MODULE)
    _distribution(
        tmp_path,
        "shadowplug",
        """
        [stagerun.transports]
        tcp = hostile_small_mod:Impostor

        [stagerun.drafters]
        ngram = hostile_small_mod:Proposer
        MixedCase = hostile_small_mod:Proposer
        twin = hostile_small_mod:Proposer
        """,
    )
    _distribution(tmp_path, "otherplug", "[stagerun.drafters]\ntwin = hostile_small_mod:Proposer\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.ENV, raising=False)
    plugins.refresh()
    yield tmp_path
    plugins.refresh()


def test_a_third_party_plugin_cannot_take_a_built_ins_name(
    hostile_plugins: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.WARNING, logger="stagerun.plugins"):
        assert isinstance(plugins.transport("tcp"), TcpTransport)
        assert isinstance(plugins.transport_for("tcp://127.0.0.1:1"), TcpTransport)
        assert plugins.drafter("ngram") is NgramDrafter
    warnings = [r.getMessage() for r in caplog.records if r.name == "stagerun.plugins"]
    assert any(
        "transport plugin 'tcp' of shadowplug 1.0 (hostile_small_mod:Impostor) is ignored" in w
        and "built-in transport of that name wins" in w
        for w in warnings
    ), warnings
    assert any("drafter plugin 'ngram' of shadowplug 1.0" in w for w in warnings), warnings
    tcp = next(i for i in plugins.installed("transports") if i.name == "tcp")
    assert tcp.distribution.startswith("stagerun ") and tcp.status == "loaded"
    # Leaving the impostor out says so explicitly, and quiets the warning.
    caplog.clear()
    monkeypatch.setenv(plugins.ENV, "-shadowplug")
    plugins.refresh()
    with caplog.at_level(logging.WARNING, logger="stagerun.plugins"):
        assert isinstance(plugins.transport("tcp"), TcpTransport)
    assert not [r for r in caplog.records if r.name == "stagerun.plugins"]


@pytest.mark.parametrize("spec", ["drafter:MixedCase", "mixedcase", "DRAFTERS:MIXEDCASE"])
def test_stagerun_plugins_names_compare_without_case(
    hostile_plugins: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    monkeypatch.setenv(plugins.ENV, spec)
    plugins.refresh()
    assert plugins.drafter("MixedCase")().propose([1], 2) == [7]
    assert "twin" not in plugins.names("drafters")  # the restriction still holds for the rest
    monkeypatch.setenv(plugins.ENV, f"-{spec}")
    plugins.refresh()
    with pytest.raises(plugins.PluginError, match=r"'MixedCase'.* excluded by STAGERUN_PLUGINS"):
        plugins.drafter("MixedCase")


def test_a_clash_between_third_party_plugins_can_be_settled_by_leaving_one_out(
    hostile_plugins: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(plugins.PluginError, match=r"registered by otherplug 1\.0.*shadowplug"):
        plugins.drafter("twin")
    monkeypatch.setenv(plugins.ENV, "-otherplug")
    plugins.refresh()
    assert plugins.drafter("twin")().propose([1], 2) == [7]
    twin = next(i for i in plugins.installed("drafters") if i.name == "twin")
    assert twin.distribution == "shadowplug 1.0"


# -- d. error messages about huge headers -----------------------------------------------------

BIG = 1_000_000  # characters, under MAX_HEADER_BYTES (1 MiB) once packed
STOP = unstructure_message(Stop(request_id=1))


def _raw(header: object, payload_len: int = 0) -> bytes:
    packed: bytes = msgpack.packb(header)
    return struct.pack("<II", len(packed), payload_len) + packed


HUGE_HEADERS = {
    "one huge string": ("x" * BIG, "must be a msgpack map"),
    "one huge bytes": (b"x" * BIG, "must be a msgpack map"),
    "a huge list": (list(range(BIG // 9)), "must be a msgpack map"),
    "a huge ext": (msgpack.ExtType(5, b"x" * BIG), "must be a msgpack map"),
    "a huge kind": ({"kind": "k" * BIG, "fields": {}}, "unknown message kind"),
    "a huge extra key": ({"kind": "stop", "fields": STOP, "x" * BIG: 0}, "exactly the entries"),
    "100,000 extra keys": (
        {"kind": "stop", "fields": STOP, **{f"k{i}": 0 for i in range(100_000)}},
        "exactly the entries",
    ),
    "a huge unknown field": (
        {"kind": "stop", "fields": {**STOP, "f" * BIG: 0}},
        "Stop has unknown field 'ffff",
    ),
    "a huge field value": (
        {"kind": "stop", "fields": {"request_id": "7" * BIG}},
        "Stop.request_id",
    ),
    "a layout of 100,000 keys": (
        {
            "kind": "decode",
            "fields": {"request_id": 1, "position": 0, "tokens": [1]},
            "layout": {f"k{i}": 0 for i in range(100_000)},
        },
        "exactly the keys dtype, rows and cols",
    ),
}


@pytest.mark.parametrize("name", list(HUGE_HEADERS))
def test_a_huge_header_gives_a_short_error_quickly(name: str) -> None:
    header, problem = HUGE_HEADERS[name]
    wire = _raw(header)
    assert len(wire) <= 8 + (1 << 20)
    decoder = FrameDecoder()
    decoder.receive_data(wire)
    start = time.perf_counter()
    with pytest.raises(ProtocolError, match=problem) as excinfo:
        decoder.next_frame()
    assert time.perf_counter() - start < 1.0  # msgpack itself takes ~0.1 s on 100,000 keys
    assert len(str(excinfo.value)) < 400, str(excinfo.value)[:400]
    with pytest.raises(ProtocolError) as again:  # the failed decoder repeats it, still short
        decoder.next_frame()
    assert len(str(again.value)) < 500


# -- e. q8 activations decode to four times their size ----------------------------------------


def _activation_header(tokens: int, dtype: str, cols: int, payload_len: int) -> bytes:
    message = Prefill(request_id=1, chunk_index=0, position=0, tokens=(1,) * tokens, predict=True)
    layout = {"dtype": dtype, "rows": tokens, "cols": cols}
    header = {"kind": "prefill", "fields": unstructure_message(message), "layout": layout}
    return _raw(header, payload_len)


def test_q8_activations_that_decode_past_the_limit_are_refused_before_their_payload() -> None:
    rows, cols = 64, 8192  # q8 on the wire: 64 * (4 + 8192) = 524,544 bytes; decoded: 2 MiB
    decoder = FrameDecoder(max_payload_bytes=1 << 20)
    decoder.receive_data(_activation_header(rows, "q8", cols, rows * (4 + cols)))
    with pytest.raises(
        ProtocolError,
        match=r"q8 activations of shape \[64, 8192\] decode to 2097152 bytes of float32, "
        r"more than the limit of 1048576 bytes",
    ):
        decoder.next_frame()  # refused with only the header in hand
    # f16 doubles: the same shape is refused too, and a separate, larger bound admits both.
    decoder = FrameDecoder(max_payload_bytes=1 << 20)
    decoder.receive_data(_activation_header(rows, "f16", cols, rows * cols * 2))
    with pytest.raises(ProtocolError, match="f16 activations"):
        decoder.next_frame()
    activations = np.ones((rows, cols), np.float32)
    frame = encode_frame(
        Prefill(request_id=1, chunk_index=0, position=0, tokens=(1,) * rows, predict=True),
        activations,
        "q8",
    )
    decoder = FrameDecoder(max_payload_bytes=1 << 20, max_decoded_bytes=2 << 20)
    decoder.receive_data(frame)
    decoded = decoder.next_frame()
    assert isinstance(decoded, Frame) and decoded.activations is not None
    np.testing.assert_allclose(decoded.activations, activations)


def test_the_default_limit_bounds_q8_by_what_it_decodes_to() -> None:
    # 4096 tokens x 65536 wide: a 256 MiB q8 payload (under the 512 MiB limit), 1 GiB decoded.
    rows, cols = 4096, 65536
    decoder = FrameDecoder()
    decoder.receive_data(_activation_header(rows, "q8", cols, rows * (4 + cols)))
    with pytest.raises(ProtocolError, match=r"decode to 1073741824 bytes of float32"):
        decoder.next_frame()
    assert decoder.pending_bytes < 1 << 20  # nothing of the payload was waited for
    with pytest.raises(ValueError, match="max_decoded_bytes must be in"):
        FrameDecoder(max_decoded_bytes=-1)
