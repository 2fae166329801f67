"""RULER's needle-in-a-haystack family (S7): ``niah_single_*``, ``niah_multikey_*``,
``niah_multivalue``, ``niah_multiquery``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from probkv._checks import check_choice, check_positive_int
from probkv.eval.haystack import HAYSTACK_KINDS, word_stream
from probkv.eval.tasks.blocks import (
    KEY_KINDS,
    KIND_NAMES,
    VALUE_DRAWS,
    Builder,
    Draft,
    UniqueValues,
    spread_depths,
)

NEEDLE_HAYSTACKS = ("noise", "prose", "needles")


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


@dataclass(frozen=True)
class NeedleTask:
    """RULER needle-in-a-haystack family: needles "A special magic <kind> for <key> is <value>."
    planted in a haystack, then one question about them.

    ``num_keys`` keys are planted (the first ``num_queries`` are asked, the rest are
    distractors), each asked key with ``num_values`` values. ``haystack="needles"`` builds the
    haystack itself from distractor needles (topped up with noise words to hit the length).
    """

    name: str
    haystack: str
    key_kind: str = "words"
    value_kind: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    max_new_tokens: int = 32
    metric: str = "string_match_all"

    def __post_init__(self) -> None:
        check_choice(self.haystack, NEEDLE_HAYSTACKS, "haystack")
        check_choice(self.key_kind, KEY_KINDS, "key_kind")
        check_choice(self.value_kind, KEY_KINDS, "value_kind")
        for name in ("num_keys", "num_values", "num_queries", "max_new_tokens"):
            check_positive_int(getattr(self, name), name)
        if self.num_queries > self.num_keys:
            raise ValueError(
                f"num_queries ({self.num_queries}) must be <= num_keys ({self.num_keys})"
            )

    def builder(self, seed_key: str, position: float, length: int) -> Builder:
        rng = random.Random(seed_key)
        used: set[str] = set()
        keys = UniqueValues(rng, VALUE_DRAWS[self.key_kind], used).take(self.num_keys)
        asked = keys[: self.num_queries]
        num_planted = self.num_queries * self.num_values + self.num_keys - self.num_queries
        values = iter(UniqueValues(rng, VALUE_DRAWS[self.value_kind], used).take(num_planted))
        # Asked keys first (``num_values`` needles each), then one needle per distractor key.
        planted = [(key, next(values)) for key in asked for _ in range(self.num_values)]
        planted += [(key, next(values)) for key in keys[self.num_queries :]]
        answers = tuple(v for k, v in planted if k in asked)
        # The first asked needle sits at ``position``; the others take the remaining slots.
        depths = spread_depths(position, len(planted))
        rest = depths[1:]
        rng.shuffle(rest)
        depths = [depths[0], *rest]

        kind, kinds = KIND_NAMES[self.value_kind]
        needle = "A special magic {kind} for {key} is {value}."
        planted_text = [needle.format(kind=kind, key=k, value=v) for k, v in planted]
        intro = (
            f"The text below hides special magic {kinds}. Pay attention to them, because a "
            "question about them follows the text.\n\n"
        )
        if self.num_queries == 1 and self.num_values == 1:
            question = f"\n\nWhat is the special magic {kind} for {asked[0]} mentioned in the provided text?"
            prefix = f"The special magic {kind} for {asked[0]} mentioned in the provided text is"
        else:
            about = _join_keys(asked)
            question = f"\n\nWhat are all the special magic {kinds} for {about} mentioned in the provided text?"
            prefix = f"The special magic {kinds} for {about} mentioned in the provided text are"
        asked_depths = [d for d, (k, _) in zip(depths, planted, strict=True) if k in asked]
        metadata = {
            "haystack": self.haystack,
            "num_needles": len(planted),
            "keys": list(asked),
            "depths": [round(d, 4) for d in asked_depths],
        }

        if self.haystack in HAYSTACK_KINDS:
            stream = word_stream(self.haystack, seed_key)

            def build(units: int, fill: int) -> Draft:
                text = stream.render(units, list(zip(depths, planted_text, strict=True)))
                return Draft(intro + text, question, prefix, answers, metadata)

            return Builder(build)

        # Haystack of distractor needles, with its own key/value streams (prefix-stable).
        d_keys = UniqueValues(random.Random(seed_key + ":keys"), VALUE_DRAWS[self.key_kind], used)
        d_values = UniqueValues(
            random.Random(seed_key + ":values"), VALUE_DRAWS[self.value_kind], used
        )
        noise = word_stream("noise", seed_key)

        def build_needles(units: int, fill: int) -> Draft:
            sentences = [
                needle.format(kind=kind, key=k, value=v)
                for k, v in zip(d_keys.take(units), d_values.take(units), strict=True)
            ]
            slots: dict[int, list[str]] = {}
            for depth, text in zip(depths, planted_text, strict=True):
                slots.setdefault(round(depth * units), []).append(text)
            out: list[str] = []
            for i in range(units + 1):
                out.extend(slots.get(i, ()))
                if i < units:
                    out.append(sentences[i])
            text = " ".join(out)
            if fill:
                text += " " + noise.render(fill)
            return Draft(intro + text, question, prefix, answers, metadata)

        # Noise words top up the last few tokens a whole needle would overshoot.
        return Builder(build_needles, fill_capacity=200)
