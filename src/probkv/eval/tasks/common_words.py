"""RULER's common words extraction (S7): ``cwe``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from probkv._checks import check_positive_int
from probkv.eval.haystack import prose_vocabulary
from probkv.eval.tasks.blocks import Builder, Draft, UniqueValues, occurs_in, pseudo_word


class _WordPool:
    """A prefix-stable sequence of distinct words: the prose vocabulary shuffled, then made-up
    words (CVCVC) once the vocabulary runs out."""

    def __init__(self, rng: random.Random) -> None:
        self.words = list(prose_vocabulary())
        rng.shuffle(self.words)
        self._extra = UniqueValues(rng, pseudo_word, set(self.words))

    def __getitem__(self, i: int) -> str:
        while i >= len(self.words):
            self.words.append(self._extra.next())
        return self.words[i]


@dataclass(frozen=True)
class CommonWordsTask:
    """RULER common words extraction: ``num_common`` words repeated often in a numbered word
    list, every other word repeated rarely; name the common ones. Below 4096 tokens the common
    words appear 6 times and the others once, from 4096 on 30 and 3 times (RULER's settings)."""

    name: str = "cwe"
    num_common: int = 10
    max_new_tokens: int = 96
    metric: str = "string_match_all"

    def __post_init__(self) -> None:
        check_positive_int(self.num_common, "num_common")
        check_positive_int(self.max_new_tokens, "max_new_tokens")

    def builder(self, seed_key: str, position: float, length: int) -> Builder:
        rng = random.Random(seed_key)
        common_repeats, rare_repeats = (30, 3) if length >= 4096 else (6, 1)
        k = self.num_common
        intro = (
            "The numbered list below repeats some words far more often than others. "
            "Note which words come up most often.\n\n"
        )
        question = f"\n\nQuestion: Which {k} words appear most often in the list above?"
        prefix = f"Answer: The {k} words that appear most often in the list are:"
        metadata = {"common_repeats": common_repeats, "rare_repeats": rare_repeats}

        def related(word: str, others: Sequence[str]) -> bool:
            return any(word in other or other in word for other in others)

        # Common words: not in the prompt's own text and not substrings of one another, so
        # that string matching credits exactly the words a prediction names.
        pool = _WordPool(rng)
        in_prompt = occurs_in(intro + question + prefix)
        common: list[str] = []
        scanned = [0]  # next pool index to look at
        while len(common) < k:
            word = pool[scanned[0]]
            scanned[0] += 1
            if not in_prompt(word) and not related(word, common):
                common.append(word)
        rare: list[str] = []

        def take_rare(n: int) -> list[str]:
            while len(rare) < n:
                word = pool[scanned[0]]
                scanned[0] += 1
                if not related(word, common):
                    rare.append(word)
            return rare[:n]

        def build(units: int, fill: int) -> Draft:
            entries = common * common_repeats + take_rare(units) * rare_repeats
            random.Random(f"{seed_key}:order:{units}").shuffle(entries)
            text = " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
            return Draft(intro + text, question, prefix, tuple(common), metadata)

        return Builder(build)
