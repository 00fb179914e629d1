"""Every span and event is declared once, in `stagerun._spans`."""

from __future__ import annotations

import ast
import pathlib
import re

from stagerun import _proto, _spans, telemetry

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "stagerun"
EMITTERS = {"span", "debug_span", "event", "emit", "timed"}
DECLARED_IN = {PACKAGE / "_spans.py", PACKAGE / "telemetry.py"}


def emitting_calls(path: pathlib.Path) -> list[str]:
    """``file:line`` of every ``<something>.span(...)``-style call in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in EMITTERS
            and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self")
        ):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_nothing_outside_the_spans_module_emits() -> None:
    stray = [
        call
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in DECLARED_IN
        for call in emitting_calls(path)
    ]
    assert stray == [], f"emit spans and events through stagerun._spans: {stray}"


def test_the_scan_finds_a_hand_built_span(tmp_path: pathlib.Path) -> None:
    """The oracle above can fail."""
    path = tmp_path / "x.py"
    path.write_text("from stagerun import telemetry\n\ntelemetry.current().span('x', 0, {})\n")
    assert emitting_calls(path) == ["x.py:3"]


def test_the_table_lists_every_span_the_module_emits() -> None:
    tree = ast.parse((PACKAGE / "_spans.py").read_text())
    table = set(re.findall(r"^``(stage\.[a-z0-9_]+)``", _spans.__doc__ or "", re.MULTILINE))
    emitted = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"stage\.[a-z0-9_]+", node.value)
    }
    assert table == emitted and len(table) == 16


def test_a_debug_span_is_skipped_unless_debug_is_on() -> None:
    tel = telemetry.Telemetry("summary")
    previous = telemetry.set_current(tel)
    try:
        message = _proto.Decode(request_id=3, position=1, tokens=(2,))
        _spans.stage_received(1, message, telemetry.now_ns())
        _spans.stage_computed(1, message, 0.001, 2)
        _spans.lane_replaced(1, 2)  # an event, not debug
        names = [record.name for record in tel.take()]
    finally:
        telemetry.set_current(previous)
    assert names == ["stage.openai_downstream_lane_replaced"]


def test_a_computed_verify_window_names_its_window() -> None:
    tel = telemetry.Telemetry("debug")
    previous = telemetry.set_current(tel)
    try:
        verify = _proto.Verify(request_id=3, window_id=7, epoch=0, position=4, tokens=(1, 2))
        _spans.stage_computed(2, verify, 0.004, 3)
        (record,) = tel.take()
    finally:
        telemetry.set_current(previous)
    assert record.name == "stage.binary_llama_decode"
    assert {k: v for k, v in record.attributes.items() if k.startswith("llama_stage.")} == {
        "llama_stage.stage_index": 2,
        "llama_stage.message_kind": "verify",
        "llama_stage.request_id": 3,
        "llama_stage.pos_start": 4,
        "llama_stage.token_count": 2,
        "llama_stage.verify_window_id": 7,
        "llama_stage.elapsed_ms": 4.0,
        "llama_stage.batch_size": 3,
    }
