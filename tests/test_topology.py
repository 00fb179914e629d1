"""Topology files."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerun._driver._topology import TopologyError, load_topology

GOOD = """
model = "smollm2"
[[stages]]
layers = [0, 10]
[[stages]]
address = "tcp://127.0.0.1:9001"
layers = [10, 20]
[[stages]]
address = "tcp://127.0.0.1:9002"
layers = [20, 30]
"""


def test_good_topology(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(GOOD)
    topology = load_topology(path)
    assert topology.model == "smollm2"
    assert topology.layer_ranges == [(0, 10), (10, 20), (20, 30)]
    assert topology.remote_addresses == ["tcp://127.0.0.1:9001", "tcp://127.0.0.1:9002"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model = 1\n[[stages]]\nlayers=[0,1]", "'model' must be"),
        ("model = 'x'", "list the stages"),
        (
            "[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[6,9]\naddress='tcp://h:1'",
            "must start at 5",
        ),
        ("[[stages]]\nlayers=[0,5]\naddress='tcp://h:1'", "takes no address"),
        ("[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[5,9]", "needs address"),
        ("[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[5,9]\naddress='nowhere'", "HOST:PORT"),
        ("[[stages]]\nlayers='0:5'", "needs layers"),
        ("[[stages]\n", "not valid TOML"),
        (
            "[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[5,9]\naddress='tcp://h:1'\nport=2",
            "unknown keys port",
        ),
        (
            "[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[5,9]\naddress='tcp://h:1'\nlisten=3",
            "listen must be",
        ),
    ],
)
def test_bad_topologies_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=message):
        load_topology(path)


def test_a_stage_may_bind_another_address_than_the_one_it_is_reached_at(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        "[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[5,30]\n"
        "address='tcp://10.0.0.2:9001'\nlisten='tcp://0.0.0.0:9001'\nbackend='torch'\n"
    )
    stage = load_topology(path).stages[1]
    assert (stage.address, stage.listen, stage.backend) == (
        "tcp://10.0.0.2:9001",
        "tcp://0.0.0.0:9001",
        "torch",
    )


def test_standby_stages_follow_their_primary(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        "[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[5,30]\naddress='tcp://h1:1'\n"
        "standby=['tcp://h2:1', 'tls://h3:1']\n"
    )
    topology = load_topology(path)
    assert topology.stages[1].standby == ("tcp://h2:1", "tls://h3:1")
    assert topology.remote_addresses == ["tcp://h1:1,tcp://h2:1,tls://h3:1"]
    path.write_text(
        "[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[5,9]\naddress='tcp://h:1'\nstandby='x'"
    )
    with pytest.raises(TopologyError, match="standby must be"):
        load_topology(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="does not exist"):
        load_topology(tmp_path / "none.toml")


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("unix:///tmp/stage1.sock", None),  # the example plugin's addresses (make test installs it)
        ("ws://127.0.0.1:9001", None),
        ("unix://tmp/stage1.sock", r"must look like unix:///ABSOLUTE/PATH\.sock"),
        ("ws://nowhere", r"must look like ws://HOST:PORT"),
        ("gopher://h:1", r"no transport plugin serves gopher://"),
    ],
)
def test_addresses_are_checked_by_the_transport_that_owns_the_scheme(
    tmp_path: Path, address: str, message: str | None
) -> None:
    path = tmp_path / "t.toml"
    path.write_text(f"[[stages]]\nlayers=[0,5]\n[[stages]]\nlayers=[5,9]\naddress='{address}'\n")
    if message is None:
        assert load_topology(path).remote_addresses == [address]
    else:
        with pytest.raises(TopologyError, match=message):
            load_topology(path)
