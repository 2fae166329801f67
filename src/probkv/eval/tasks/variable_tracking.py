"""RULER's variable tracking (S7): ``vt``, chains of variable assignments."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from probkv._checks import check_choice, check_positive_int
from probkv.eval.haystack import HAYSTACK_KINDS, prose_vocabulary, word_stream
from probkv.eval.tasks.blocks import Builder, Draft, UniqueValues, occurs_in, spread_depths


def _draw_variable(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


@dataclass(frozen=True)
class VariableTrackingTask:
    """RULER variable tracking: chains "VAR A = 12345.", "VAR B = VAR A.", ... (``num_hops``
    copies) hidden in the noise haystack, next to ``num_chains - 1`` distractor chains with other
    values. The question gives the asked chain's value; the answer is every variable of that
    chain."""

    name: str = "vt"
    num_hops: int = 4
    num_chains: int = 3
    haystack: str = "noise"
    max_new_tokens: int = 48
    metric: str = "string_match_all"

    def __post_init__(self) -> None:
        check_positive_int(self.num_hops, "num_hops")
        check_positive_int(self.num_chains, "num_chains")
        check_positive_int(self.max_new_tokens, "max_new_tokens")
        check_choice(self.haystack, HAYSTACK_KINDS, "haystack")

    def builder(self, seed_key: str, position: float, length: int) -> Builder:
        rng = random.Random(seed_key)
        question_template = (
            "\n\nQuestion: Which variables are assigned the value {value}, directly or through a "
            "chain of assignments, in the text above? List all of them."
        )
        prefix_template = "Answer: The variables that are assigned the value {value} are:"
        reserved = {w.upper() for w in prose_vocabulary()}
        names = UniqueValues(
            rng, _draw_variable, reserved, occurs_in(question_template + prefix_template)
        ).take(self.num_chains * (self.num_hops + 1))
        values = UniqueValues(rng, lambda r: str(r.randint(10_000, 99_999)), set()).take(
            self.num_chains
        )
        chains: list[list[str]] = []
        for c in range(self.num_chains):
            chain_names = names[c * (self.num_hops + 1) : (c + 1) * (self.num_hops + 1)]
            statements = [f"VAR {chain_names[0]} = {values[c]}."]
            statements += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(chain_names)]
            chains.append(statements)
        # Interleave the chains at random, keeping each chain in order, spread over the text.
        order = [c for c in range(self.num_chains) for _ in range(self.num_hops + 1)]
        rng.shuffle(order)
        cursor = [0] * self.num_chains
        sequence = []
        for c in order:
            sequence.append(chains[c][cursor[c]])
            cursor[c] += 1
        depths = sorted(spread_depths(position, len(sequence)))
        answers = tuple(names[: self.num_hops + 1])
        value = values[0]
        intro = (
            "Keep track of the variable assignments in the text below: a variable either gets a "
            "number directly or copies the value of another variable.\n\n"
        )
        question = question_template.format(value=value)
        prefix = prefix_template.format(value=value)
        metadata = {
            "haystack": self.haystack,
            "num_hops": self.num_hops,
            "num_chains": self.num_chains,
        }
        stream = word_stream(self.haystack, seed_key)

        def build(units: int, fill: int) -> Draft:
            text = stream.render(units, list(zip(depths, sequence, strict=True)))
            return Draft(intro + text, question, prefix, answers, metadata)

        return Builder(build)
