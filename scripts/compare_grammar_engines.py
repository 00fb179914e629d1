"""Compare grammar engines for constrained decoding on this machine (issue 30's choice).

For each model's vocabulary: the time to make the engine's tokenizer or vocabulary, to
compile one JSON schema, and to compute the next-token mask at every token of an answer that
fits the schema (the per-token cost a constrained request pays), plus rollback and forced
tokens. xgrammar is reported from its wheel's requirements (torch, transformers, triton).

    .venv/bin/pip install llguidance outlines-core
    .venv/bin/python scripts/compare_grammar_engines.py smollm2 gemma3-270m
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from stagerun.model import open_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}


def _timed(work: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = work()
    return out, time.perf_counter() - started


def _report(engine: str, setup: float, compile_s: float, masks: list[float], extra: str) -> None:
    print(
        f"  {engine:14s} setup {setup * 1000:7.1f} ms, schema {compile_s * 1000:7.1f} ms, "
        f"mask per token median {statistics.median(masks) * 1e6:7.1f} us, "
        f"max {max(masks) * 1e6:8.1f} us over {len(masks)} tokens; {extra}"
    )


def llguidance_run(tokenizer: Any, ids: list[int]) -> None:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    ll, setup = _timed(
        lambda: llguidance.LLTokenizer(tokenizer._backend.to_str(), eos_token=tokenizer.eos_id)
    )
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher, compile_s = _timed(lambda: llguidance.LLMatcher(ll, grammar))
    forced = tokenizer.decode(matcher.compute_ff_tokens())
    mask = allocate_token_bitmask(1, ll.vocab_size)
    masks = []
    for token in ids:
        _, took = _timed(lambda: fill_next_token_bitmask(matcher, mask))
        masks.append(took)
        if not matcher.consume_token(token):
            raise RuntimeError(matcher.get_error())
    rolled = matcher.rollback(3) and not matcher.is_error()
    _report("llguidance", setup, compile_s, masks,
            f"rollback {'yes' if rolled else 'no'}, forced at the start {forced!r}")  # fmt: skip


def outlines_run(tokenizer: Any, ids: list[int]) -> None:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary() -> Any:
        table: dict[bytes, list[int]] = {}
        for token in range(tokenizer.vocab_size):
            if token != tokenizer.eos_id:
                table.setdefault(tokenizer.token_bytes(token), []).append(token)
        return outlines_core.Vocabulary(tokenizer.eos_id, table)

    vocab, setup = _timed(vocabulary)
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    index, compile_s = _timed(lambda: outlines_core.Index(regex, vocab))
    guide = outlines_core.Guide(index)
    mask = np.zeros((tokenizer.vocab_size + 31) // 32, np.int32)
    masks = []
    for token in ids:
        _, took = _timed(lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4))
        masks.append(took)
        guide.advance(token)
    guide.rollback_state(3)
    _report("outlines-core", setup, compile_s, masks,
            "rollback yes (states kept), regex only: no Lark/GBNF, no recursive schemas, "
            "no forced-token query")  # fmt: skip


def main(models: list[str]) -> None:
    text = json.dumps(ANSWER, separators=(",", ":"))
    for name in models:
        tokenizer = open_model(name).tokenizer
        ids = [*tokenizer.encode(text, add_bos=False), tokenizer.eos_id]
        print(f"{name}: vocabulary {tokenizer.vocab_size}, answer {len(ids)} tokens")
        llguidance_run(tokenizer, ids)
        outlines_run(tokenizer, ids[:-1])
    print("  xgrammar       not run: its wheel requires torch, transformers and triton")


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2", "gemma3-270m"])
