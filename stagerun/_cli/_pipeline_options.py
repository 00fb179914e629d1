"""The options that say which pipeline to run: model, threads, plugins, and an emulated link.

`._options` (``generate``, ``serve``) and `._bench_options` both build their parsers from them.
"""

from __future__ import annotations

import argparse
import math

from .._engine._config import DEFAULT_INLINE_COMPUTE_MS
from .._engine._prefix import DEFAULT_PREFIX_CACHE_MB

MAX_TEMPLATE_BYTES = 1 << 20  # real templates are 1-10 kB


def _add_pipeline_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="smollm2",
        help="model name (smollm2, gemma3-270m) or GGUF path (default: smollm2)",
    )  # fmt: skip
    chat_template_option(p)
    p.add_argument("--threads", type=int, default=None, help="compute threads per stage")
    p.add_argument(
        "--inproc",
        action="store_true",
        help="run all stages as tasks in this process (default: one process per stage)",
    )
    p.add_argument(
        "--wire-dtype",
        choices=["f32", "f16", "q8"],
        default="f32",
        help="activation dtype on lanes",
    )
    _plugin_options(p)


def chat_template_option(p: argparse.ArgumentParser) -> None:
    """``--chat-template FILE``: the Jinja template of chat prompts, in place of the model's."""
    p.add_argument(
        "--chat-template", type=_template_file, default=None, metavar="FILE",
        help="a Jinja chat template for chat prompts, in place of the model's (a model "
        "without one, like the base gemma3-270m, refuses chat prompts)",
    )  # fmt: skip


def _template_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {path!r}: {exc}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"the chat template {path!r} is not UTF-8 text") from None
    if len(text) > MAX_TEMPLATE_BYTES:
        raise argparse.ArgumentTypeError(
            f"the chat template {path!r} is over {MAX_TEMPLATE_BYTES} characters"
        )
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the chat template {path!r} is empty")
    return text


def _transport_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"transports {text!r} must look like ws,tcp")
    return names


def _thread_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"thread counts {text!r} must look like 2,1,1")
    return counts


def _plugin_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stage-threads",
        type=_thread_counts,
        default=None,
        metavar="N,N,...",
        help="compute threads per stage instead of --threads, stage 0 first, e.g. 2,1,1",
    )
    p.add_argument(
        "--transport",
        default="tcp",
        help="transport plugin of every lane between local stages (default tcp; see "
        "`stagerun plugins`)",
    )
    p.add_argument(
        "--transports",
        type=_transport_list,
        default=None,
        help="one transport per hop instead, stage 0->1 first, e.g. ws,tcp",
    )
    p.add_argument(
        "--backend",
        default="auto",
        help="compute backend plugin (default auto: ggml where it runs, else numpy)",
    )
    p.add_argument(
        "--backends",
        type=_transport_list,
        default=None,
        help="one backend per stage instead, stage 0 first, e.g. numpy,torch,numpy",
    )
    p.add_argument(
        "--device",
        default=None,
        help="compute device for backends that take one (torch): cuda, cuda:1, cpu",
    )
    flash_attention_option(p)
    prefix_cache_options(p)
    inline_compute_option(p)


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    if not (0 <= value < math.inf):
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more milliseconds")
    return value


def inline_compute_option(p: argparse.ArgumentParser) -> None:
    """``--inline-compute-ms``: how long a quick tick may hold the event loop."""
    p.add_argument(
        "--inline-compute-ms", type=_milliseconds, default=DEFAULT_INLINE_COMPUTE_MS,
        metavar="MS",
        help="a tick of one request's decode step runs on the event loop's thread while such "
        "ticks take at most this long, saving two thread hand-offs a token (0: never; "
        f"default {DEFAULT_INLINE_COMPUTE_MS:g})",
    )  # fmt: skip


def _megabytes(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB")
    return int(text)


def prefix_cache_options(p: argparse.ArgumentParser) -> None:
    """``--prefix-cache on|off`` and ``--prefix-cache-mb`` (docs/prefix-cache.md)."""
    p.add_argument(
        "--prefix-cache", choices=["on", "off"], default="on",
        help="reuse the KV of earlier requests' prefixes on every stage (default on)",
    )  # fmt: skip
    p.add_argument(
        "--prefix-cache-mb", type=_megabytes, default=DEFAULT_PREFIX_CACHE_MB, metavar="MIB",
        help="KV each stage may keep for later requests; running requests take room back "
        f"from it (default {DEFAULT_PREFIX_CACHE_MB})",
    )  # fmt: skip


def _link_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hop-delay-ms",
        type=float,
        default=0.0,
        help="emulate a WAN link: deliver every lane frame this much later (default 0)",
    )
    p.add_argument(
        "--bandwidth-mbps", type=float, default=None, help="emulate a link of this bandwidth"
    )


def flash_attention_option(p: argparse.ArgumentParser) -> None:
    """``--flash-attention on|off``: ggml's attention kernel (unset: the backend's default)."""
    p.add_argument(
        "--flash-attention",
        type=_on_off,
        default=None,
        metavar="{on,off}",
        help="ggml stages: attend with the fused kernel (on, the default; llama.cpp's -fa on) or "
        "as scores, softmax and values apart (off: -fa off's numerics, slower)",
    )


def _on_off(value: str) -> bool:
    if value.lower() not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value.lower() == "on"
