"""Forced drafts, measured: a JSON-schema answer with and without them, side by side.

The same request (greedy, a schema of long fixed keys) through three stages over links with
20 ms of delay per hop, with ``SpeculationConfig(forced=True)`` and ``False``: the answers
must be identical; the report gives tokens, pipeline traversals (the prefill and one per
verify window or decode step) and tokens per second of each.

    .venv/bin/python scripts/forced_drafts.py [--stages 3] [--hop-delay-ms 20]
"""

from __future__ import annotations

import argparse
import json
import time

import llguidance
import trio

from stagerun import SamplingParams, SpeculationConfig, open_pipeline

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name_as_written_on_the_order": {"type": "string", "maxLength": 24},
        "customer_is_a_premium_member_of_the_club": {"type": "boolean"},
        "preferred_method_of_contact_for_deliveries": {"enum": ["email", "phone", "post"]},
        "number_of_orders_placed_in_the_last_year": {"type": "integer", "maximum": 999},
        "delivery_address_country_name_in_english": {"enum": ["France", "Japan", "Peru"]},
    },
    "required": [
        "customer_full_name_as_written_on_the_order",
        "customer_is_a_premium_member_of_the_club",
        "preferred_method_of_contact_for_deliveries",
        "number_of_orders_placed_in_the_last_year",
        "delivery_address_country_name_in_english",
    ],
    "additionalProperties": False,
}
PROMPT = "Write the order record of Ada Lovelace as JSON:"


async def main(stages: int, hop_delay_ms: float) -> None:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    sampling = SamplingParams(temperature=0.0, grammar=grammar)
    async with open_pipeline("smollm2", stages=stages, hop_delay_ms=hop_delay_ms) as pipeline:
        results = {}
        for forced in (True, False):
            speculation = SpeculationConfig(forced=forced)
            started = time.perf_counter()
            done = await pipeline.complete(PROMPT, max_tokens=200, sampling=sampling,
                                           speculation=speculation)  # fmt: skip
            seconds = time.perf_counter() - started
            spec = done.timings.speculation
            traversals = 1 + (spec.windows.opened_windows if spec else len(done.token_ids) - 1)
            json.loads(done.text)  # it parses
            results[forced] = done.text
            n = len(done.token_ids)
            print(f"forced drafts {'on ' if forced else 'off'}: {n} tokens, {traversals} "
                  f"traversals ({n / traversals:.2f} tokens per traversal), "
                  f"{n / seconds:.1f} tokens/s over {seconds:.2f} s")  # fmt: skip
        assert results[True] == results[False], "forced drafts changed the answer"
        print("identical answers:", results[True])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--hop-delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    trio.run(main, args.stages, args.hop_delay_ms)
