"""Forced drafts: a grammar's only continuations travel as verify windows, and change nothing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import llguidance

from stagerun import SamplingParams, SpeculationConfig, open_pipeline
from stagerun._driver._forced import GrammarDrafter
from stagerun._engine import Grammars
from stagerun.abc import Drafter
from stagerun.model import open_model
from stagerun.testing import write_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "a_rather_long_fixed_key_name": {"type": "boolean"},
        "another_long_key_for_the_count": {"enum": [1, 2, 3]},
        "and_a_third_one_for_the_colour": {"enum": ["red", "green"]},
    },
    "required": ["a_rather_long_fixed_key_name", "another_long_key_for_the_count",
                 "and_a_third_one_for_the_colour"],
    "additionalProperties": False,
}  # fmt: skip
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(
    SCHEMA, defaults={"whitespace_flexible": False}
)


class _Guesses(Drafter):
    blocking = False

    def __init__(self, guesses: Sequence[int]) -> None:
        self.guesses = list(guesses)

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def commit(self, tokens: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int) -> Sequence[int]:
        return self.guesses[:max_tokens]


def test_forced_tokens_come_first_and_other_drafts_stop_where_the_grammar_does(
    tmp_path: Path,
) -> None:
    model = open_model(write_tiny_model(tmp_path / "tiny.gguf", n_layers=2))
    grammars = Grammars(model.tokenizer, model.config.vocab_size)
    encode = model.tokenizer.encode
    opening = encode('{"a_rather_long_fixed_key_name":', add_bos=False)
    good, bad = encode("true", add_bos=False), encode("maybe", add_bos=False)
    drafter = GrammarDrafter(grammars.matcher(GRAMMAR), _Guesses([*good, *bad]))
    drafter.begin([1, 2, 3])
    proposal = list(drafter.propose([1, 2, 3], 40))
    text = model.tokenizer.decode(proposal)
    assert text.startswith('{"a_rather_long_fixed_key_name":true') and "maybe" not in text
    assert drafter.certain == len(opening)  # the rest were the other drafter's, cut
    # Later: after the boolean, the next key is forced again.
    context = [1, 2, 3, *opening, *good]
    forced = drafter.propose(context, 0)
    assert model.tokenizer.decode(list(forced)).startswith(',"another_long_key_for_the_count":')
    assert drafter.propose([1, 2, 3, *bad], 4) == ()  # a context the grammar refuses


async def test_forced_drafts_cut_traversals_and_change_no_answer(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=4)
    answers = {}
    async with open_pipeline(model, stages=3) as pipeline:
        for seed in (1, 2):
            sampling = SamplingParams(temperature=0.8, seed=seed, grammar=GRAMMAR)
            for forced in (True, False):
                speculation = SpeculationConfig(forced=forced)
                done = await pipeline.complete(
                    "once upon a time", max_tokens=200, sampling=sampling, speculation=speculation
                )
                spec = done.timings.speculation
                n = len(done.token_ids)
                traversals = 1 + (spec.windows.opened_windows if spec else n - 1)
                answers[seed, forced] = (done.text, traversals, n)
    for seed in (1, 2):
        text, traversals, n = answers[seed, True]
        plain_text, plain_traversals, _ = answers[seed, False]
        assert text == plain_text
        assert text.endswith("}")
        assert plain_traversals == n and traversals * 2 <= n, (traversals, n)
    assert answers[1, True][0] != answers[2, True][0]  # the answers vary with the seed
