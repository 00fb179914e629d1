"""Three hosts in network namespaces: a pipeline across veth links, with delay on the wire.

Four namespaces: a switch (a Linux bridge) and three hosts on 10.77.N.0/24, each joined to
the bridge by a veth pair. Stages 1 and 2 run as ``stagerun stage --topology FILE --index I``
in their hosts; stage 0 runs ``stagerun generate --topology FILE`` in the third. Nothing is
configured in the namespace the tests run in. Every host link gets a netem delay where the
kernel has netem; where it has not, the stages emulate the same delay themselves
(``--hop-delay-ms``), and the test says which one it used.

Needs root (CAP_NET_ADMIN) and ``ip``: without them the test is skipped and says so.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import trio
from _oracle import assert_varied

from stagerun import open_pipeline

PROMPT = "The lighthouse keeper climbed the stairs"
DELAY_MS = 5
TOKENS = 24


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


def _must(*cmd: str) -> None:
    done = _run(*cmd)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr.strip()}"


def _namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"srprobe{os.getpid()}"
    done = _run("ip", "netns", "add", probe)
    if done.returncode != 0:
        return f"this machine does not allow network namespaces ({done.stderr.strip()})"
    _run("ip", "netns", "del", probe)
    return None


@pytest.fixture
def hosts() -> Iterator[tuple[list[str], bool]]:
    """Three host namespaces on one bridge; yields their names and whether netem is on."""
    reason = _namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    switch = f"sr{tag}sw"
    names = [f"sr{tag}h{i}" for i in range(3)]
    created: list[str] = []
    netem = True
    try:
        for ns in (switch, *names):
            _must("ip", "netns", "add", ns)
            created.append(ns)
        _must("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _must("ip", "-n", switch, "link", "set", "br0", "up")
        for i, ns in enumerate(names):
            host_end, switch_end = f"sr{tag}e{i}", f"sr{tag}p{i}"
            _must("ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _must("ip", "link", "set", host_end, "netns", ns)
            _must("ip", "link", "set", switch_end, "netns", switch)
            _must("ip", "-n", switch, "link", "set", switch_end, "master", "br0")
            _must("ip", "-n", switch, "link", "set", switch_end, "up")
            _must("ip", "-n", ns, "addr", "add", f"10.77.0.{10 + i}/24", "dev", host_end)
            _must("ip", "-n", ns, "link", "set", host_end, "up")
            _must("ip", "-n", ns, "link", "set", "lo", "up")
            if netem:
                done = _run(
                    "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", host_end, "root",
                    "netem", "delay", f"{DELAY_MS}ms",
                )  # fmt: skip
                netem = done.returncode == 0
        yield names, netem
    finally:
        for ns in created:  # deleting a namespace deletes its end of every veth pair
            _run("ip", "netns", "del", ns)


def test_a_three_host_pipeline_across_namespaces(
    hosts: tuple[list[str], bool], tiny_model_path: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    names, netem = hosts
    print(f"\nlink delay: {'netem' if netem else 'stagerun --hop-delay-ms (no netem here)'}")
    delay = [] if netem else ["--hop-delay-ms", str(DELAY_MS)]
    # stages that listen beyond loopback authenticate their lanes (without a secret they
    # refuse to start unless told --insecure)
    secret = tmp_path / "lane.secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    delay += ["--secret-file", str(secret)]
    topology = tmp_path / "topology.toml"
    topology.write_text(
        f'model = "{tiny_model_path}"\n'
        "[[stages]]\nlayers = [0, 1]\n"
        '[[stages]]\naddress = "tcp://10.77.0.11:9001"\nlayers = [1, 3]\n'
        '[[stages]]\naddress = "tcp://10.77.0.12:9002"\nlayers = [3, 4]\n'
    )
    stages: list[subprocess.Popen[bytes]] = []
    try:
        for index in (2, 1):
            proc = subprocess.Popen(
                ["ip", "netns", "exec", names[index], sys.executable, "-m", "stagerun", "stage",
                 "--topology", str(topology), "--index", str(index), *delay],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            stages.append(proc)
            assert proc.stdout is not None
            line = proc.stdout.readline().decode().strip()
            assert line == f"READY tcp://10.77.0.1{index}:900{index}", line
        out = subprocess.run(
            ["ip", "netns", "exec", names[0], sys.executable, "-m", "stagerun", "generate",
             "--topology", str(topology), "--max-tokens", str(TOKENS), "--json", *delay, PROMPT],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        across = json.loads(out.stdout)
    finally:
        for proc in stages:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()

    async def local() -> list[int]:
        async with open_pipeline(tiny_model_path, layers=[(0, 1), (1, 3), (3, 4)]) as pipeline:
            return (await pipeline.complete(PROMPT, max_tokens=TOKENS)).token_ids

    want = trio.run(local)
    assert_varied(want)
    assert across["token_ids"] == want
    # Every decode step crosses three links (0->1, 1->2, 2->0), each delayed.
    step_ms = across["timings"]["predicted_ms"] / max(len(across["token_ids"]) - 1, 1)
    print(f"decode step across the namespaces: {step_ms:.1f} ms")
    assert step_ms >= 2 * DELAY_MS
