"""Topology files: which stage holds which layers, and where it listens.

A topology is a TOML file shared by every host of a pipeline::

    model = "smollm2"            # name or GGUF path, as each host can resolve it

    [[stages]]                   # stage 0: the host that runs `stagerun serve`
    layers = [0, 10]

    [[stages]]
    address = "tcp://10.0.0.2:9001"
    layers = [10, 20]
    backend = "torch"            # optional, default numpy
    listen = "tcp://0.0.0.0:9001"  # optional: what the stage binds, if not its address
    standby = ["tcp://10.0.0.4:9001"]  # optional: stages with the same layers, tried in order

    [[stages]]
    address = "tcp://10.0.0.3:9001"
    layers = [20, 30]

Stage 0 has no address (it is the driver); every other stage must have one: it is where the
previous stage connects, so it must be reachable from there. The layer ranges must be
contiguous from 0 (the model's layer count is checked when the model is opened). Each host runs
``stagerun stage --topology FILE --index I``; stage 0 runs ``stagerun serve --topology FILE``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import attrs

from .. import plugins


class TopologyError(ValueError):
    """A topology file is malformed; the message names the file and the entry."""


@attrs.frozen
class TopologyStage:
    index: int
    layers: tuple[int, int]
    address: str | None
    backend: str = "auto"
    listen: str | None = None
    standby: tuple[str, ...] = ()

    @property
    def addresses(self) -> str:
        """The address and its standbys, comma-separated (what connecting stages try)."""
        return ",".join([self.address or "", *self.standby])


@attrs.frozen
class Topology:
    model: str
    stages: tuple[TopologyStage, ...]

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]

    @property
    def remote_addresses(self) -> list[str]:
        """Stages 1.. as stage 0 reaches them: each address followed by its standbys."""
        return [s.addresses for s in self.stages[1:] if s.address is not None]


def check_address(address: str) -> None:
    """Check ``address`` with the transport plugin that serves its scheme.

    Raises:
        ValueError: no transport serves the scheme, or the address is not of its form.
    """
    try:
        transport = plugins.transport_for(address)
    except plugins.PluginError as exc:
        raise ValueError(str(exc)) from None
    check = getattr(transport, "check_address", None)  # a plugin need not subclass Transport
    if check is not None:
        check(address)


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Read and check a topology file."""
    where = Path(path)
    try:
        data = tomllib.loads(where.read_text())
    except FileNotFoundError:
        raise TopologyError(f"topology file {where} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"topology file {where} is not valid TOML: {exc}") from exc
    return parse_topology(data, source=str(where))


def parse_topology(data: dict[str, Any], *, source: str = "<topology>") -> Topology:
    model = data.get("model", "smollm2")
    if not isinstance(model, str) or not model:
        raise TopologyError(f"{source}: 'model' must be a model name or GGUF path")
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, list) or len(raw_stages) < 1:
        raise TopologyError(f"{source}: list the stages as [[stages]] tables")
    stages = []
    expected_lo = 0
    for index, raw in enumerate(raw_stages):
        if not isinstance(raw, dict):
            raise TopologyError(f"{source}: stage {index} must be a table")
        layers = raw.get("layers")
        if (
            not isinstance(layers, list)
            or len(layers) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        ):
            raise TopologyError(f"{source}: stage {index} needs layers = [LO, HI]")
        lo, hi = layers
        if lo != expected_lo or hi <= lo:
            raise TopologyError(
                f"{source}: stage {index} has layers [{lo}, {hi}] but must start at "
                f"{expected_lo} and hold at least one layer"
            )
        expected_lo = hi
        address = raw.get("address")
        if index == 0 and address is not None:
            raise TopologyError(f"{source}: stage 0 is the driver and takes no address")
        if index > 0:
            if not isinstance(address, str):
                raise TopologyError(f'{source}: stage {index} needs address = "tcp://HOST:PORT"')
            try:
                check_address(address)
            except ValueError as exc:
                raise TopologyError(f"{source}: stage {index}: {exc}") from None
        backend = raw.get("backend", "auto")
        if not isinstance(backend, str):
            raise TopologyError(f"{source}: stage {index} backend must be a name")
        listen = raw.get("listen")
        if listen is not None:
            if index == 0 or not isinstance(listen, str):
                raise TopologyError(f'{source}: stage {index} listen must be "tcp://HOST:PORT"')
            try:
                check_address(listen)
            except ValueError as exc:
                raise TopologyError(f"{source}: stage {index} listen: {exc}") from None
        standby = raw.get("standby", [])
        if not isinstance(standby, list) or not all(isinstance(a, str) for a in standby):
            raise TopologyError(f'{source}: stage {index} standby must be ["tcp://HOST:PORT", ...]')
        if standby and index == 0:
            raise TopologyError(f"{source}: stage 0 is the driver and has no standby")
        for other in standby:
            try:
                check_address(other)
            except ValueError as exc:
                raise TopologyError(f"{source}: stage {index} standby: {exc}") from None
        unknown = set(raw) - {"layers", "address", "backend", "listen", "standby"}
        if unknown:
            raise TopologyError(
                f"{source}: stage {index} has unknown keys {', '.join(sorted(unknown))}"
            )
        stages.append(TopologyStage(index, (lo, hi), address, backend, listen, tuple(standby)))
    return Topology(model, tuple(stages))
