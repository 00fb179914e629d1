"""``stagerun bench serve``'s run: the servers, the levels in rounds, the report.

The clients, a level's figures and the report's printing are `_serve`'s.

Theory of operation. On the 2-core VMs this project is measured on, a system's tokens/s
drifts by more than 10% between runs a few minutes apart, so a ratio of two systems measured
one after the other carries that drift. Here every server a level needs is up at once: the
stagerun server for the whole run, llama-server (and llama.cpp's RPC split) one per level,
``-np`` clients as before. Each round measures each system once, the order reversed every
other round (stagerun first, then last, ...), so slow and fast spells fall on all of them
alike. A level's row is its median round's (the lower of the two middle ones for an even
count), with every round's tokens/s beside it and the mismatches and 429s of all rounds.
One round is the plain side-by-side run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Sequence
from typing import Any

from ...backends._ggml._lib import LIBRARY_ENV
from ._common import say
from ._rpc import rpc_binaries, rpc_split
from ._serve import (
    _check,
    _curve,
    _measure_level,
    _print_report,
    _prompts,
    _solo,
    _Target,
    plot_scaling,
)  # fmt: skip
from ._servers import free_port, launched, llama_command, serve_command

__all__ = ["bench_serve", "measure_systems", "median_round"]


def median_round(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One level's rounds as one row: the median round's figures, every round's tokens/s
    (``rounds_tokens_per_second``, in the order measured), and all rounds' mismatches and
    429s."""
    ordered = sorted(rows, key=lambda row: row["tokens_per_second"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["rounds_tokens_per_second"] = [r["tokens_per_second"] for r in rows]
    row["mismatches"] = sum(r["mismatches"] for r in rows)
    row["rejected"] = sum(r["rejected"] for r in rows)
    return row


async def _stagerun(
    stack: contextlib.AsyncExitStack, args: argparse.Namespace, prompts: tuple[str, ...]
) -> tuple[_Target, list[str]]:
    """The stagerun server, started once for the whole run, and its solo outputs."""
    from ...server._serve import served_model_id

    port = free_port()
    cmd = serve_command(args, port)
    say(args, "starting " + " ".join(cmd[2:]))
    proc = await stack.enter_async_context(launched(cmd, port, "stagerun serve"))
    target = _Target("stagerun", port, proc.pid, served_model_id(args.model), prompts,
                     args.tokens, chat=args.prompts == "copy")  # fmt: skip
    solo = await _solo(target)
    say(args, f"stagerun: {len(prompts)} prompts completed alone")
    return target, solo


async def _llama(
    stack: contextlib.AsyncExitStack, args: argparse.Namespace, prompts: tuple[str, ...],
    clients: int, *, rpc: bool,
) -> _Target:  # fmt: skip
    """llama-server ``-np clients`` for one level; with ``rpc``, its RPC build over
    ``--stages`` RPC servers behind the emulated links (`_rpc`)."""
    from ...model import resolve_model

    gguf = resolve_model(args.model)
    name = "llama.cpp RPC" if rpc else "llama-server"
    port = free_port()
    cmd = llama_command(args, gguf, clients, port)
    if rpc:
        cmd[0] = str(rpc_binaries()[0])
        cmd += await stack.enter_async_context(rpc_split(args))
    say(args, "starting " + " ".join(cmd))
    proc = await stack.enter_async_context(launched(cmd, port, name))
    return _Target(name, port, proc.pid, gguf.stem, prompts, args.tokens,
                   chat=args.prompts == "copy")  # fmt: skip


async def _rounds(
    args: argparse.Namespace, targets: dict[str, _Target], solos: dict[str, list[str]],
    clients: int,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """One level, ``args.rounds`` times, the systems taking turns (the order reversed every
    other round): each system's `median_round`."""
    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in targets}
    for r in range(args.rounds):
        for key in list(targets) if r % 2 == 0 else list(targets)[::-1]:
            rounds[key].append(await _measure_level(args, targets[key], clients, solos[key]))
    return {key: median_round(rows) for key, rows in rounds.items()}


async def measure_systems(
    args: argparse.Namespace, prompts: tuple[str, ...]
) -> dict[str, dict[str, Any] | None]:
    """Each system's curve, by report key (``stagerun``, ``llama_server``, ``llama_rpc``;
    None for one not asked for), its levels measured in turn over ``args.rounds`` rounds."""
    others = [key for key, wanted in (("llama_server", args.compare_llama_server),
                                      ("llama_rpc", args.compare_rpc)) if wanted]  # fmt: skip
    levels: dict[str, list[dict[str, Any]]] = {key: [] for key in ("stagerun", *others)}
    solos: dict[str, list[str]] = {}
    async with contextlib.AsyncExitStack() as run:
        targets: dict[str, _Target] = {}
        targets["stagerun"], solos["stagerun"] = await _stagerun(run, args, prompts)
        for clients in args.clients:
            async with contextlib.AsyncExitStack() as level:
                for key in others:
                    target = await _llama(level, args, prompts, clients, rpc=key == "llama_rpc")
                    if key in solos:
                        await target.complete(0)  # warm-up
                    else:
                        solos[key] = await _solo(target)
                    targets[key] = target
                for key, row in (await _rounds(args, targets, solos, clients)).items():
                    levels[key].append(row)
    curves: dict[str, dict[str, Any] | None] = {"llama_server": None, "llama_rpc": None}
    curves.update({key: _curve(rows) for key, rows in levels.items()})
    return curves


async def bench_serve(args: argparse.Namespace) -> int:
    """Tokens/s and latencies per client count, outputs checked; 1 if any output differed."""
    _check(args)
    prompts = _prompts(args.prompts, max(args.clients))
    report: dict[str, Any] = {
        "benchmark": "serve", "model": args.model, "stages": args.stages,
        "clients": args.clients, "tokens": args.tokens,
        "requests_per_client": args.requests_per_client, "hop_delay_ms": args.hop_delay_ms,
        "speculative": args.speculative, "max_batch": args.max_batch, "prompts": len(prompts),
        "prompt_kind": args.prompts, "rounds": args.rounds,
        "ggml_library": os.environ.get(LIBRARY_ENV),  # None: the wheel's (or no ggml)
    }  # fmt: skip
    report.update(await measure_systems(args, prompts))
    report["mismatches"] = sum(row["mismatches"] for row in report["stagerun"]["levels"])
    if args.png:
        plot_scaling(report, args.png)
        say(args, f"wrote {args.png}")
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0 if report["mismatches"] == 0 else 1
