"""Question answering over planted facts (S7): ``qa``, RULER's QA family without its
downloaded data sets."""

from __future__ import annotations

import random
from dataclasses import dataclass

from probkv._checks import check_choice, check_positive_int
from probkv.eval.haystack import HAYSTACK_KINDS, prose_vocabulary, word_stream
from probkv.eval.haystack.vocabulary import FIRST_NAMES
from probkv.eval.tasks.blocks import Builder, Draft, UniqueValues, pseudo_word, spread_depths

_TOWN_SUFFIXES = ("wick", "moor", "ford", "holm", "stead", "bury", "dale", "mere", "by", "thorpe")
_BOAT_WORDS = (
    ("Silver", "Golden", "Morning", "Evening", "Northern", "Quiet", "Swift", "Little", "Bold"),
    ("Heron", "Swallow", "Tern", "Otter", "Lark", "Falcon", "Petrel", "Wren", "Seal", "Gannet"),
)
_ANIMALS = ("dog", "cat", "parrot", "goat", "pony", "tortoise", "rabbit", "donkey", "goose")


def _proper(rng: random.Random, syllables: int) -> str:
    return pseudo_word(rng, syllables).capitalize()


@dataclass(frozen=True)
class _Fact:
    statement: str
    question: str
    answers: tuple[str, ...]


def _draw_fact(rng: random.Random, person: str) -> _Fact:
    relation = rng.randrange(5)
    if relation == 0:
        town = _proper(rng, 1) + rng.choice(_TOWN_SUFFIXES)
        return _Fact(
            f"{person} was born in the town of {town}.",
            f"In which town was {person} born?",
            (town,),
        )
    if relation == 1:
        animal, name = rng.choice(_ANIMALS), _proper(rng, 2)
        return _Fact(
            f"{person} has a {animal} called {name}.",
            f"What is the name of the {animal} that {person} has?",
            (name,),
        )
    if relation == 2:
        town, year = _proper(rng, 1) + rng.choice(_TOWN_SUFFIXES), str(rng.randint(1720, 1990))
        return _Fact(
            f"{person} moved to {town} in the year {year}.",
            f"In which year did {person} move to {town}?",
            (year,),
        )
    if relation == 3:
        boat = f"{rng.choice(_BOAT_WORDS[0])} {rng.choice(_BOAT_WORDS[1])}"
        return _Fact(
            f"{person} owns a small boat named the {boat}.",
            f"What is the name of the boat that {person} owns?",
            (boat,),
        )
    street = _proper(rng, 2)
    return _Fact(
        f"{person} lives on {street} Street.",
        f"On which street does {person} live?",
        (f"{street} Street", street),
    )


@dataclass(frozen=True)
class FactQATask:
    """Question answering over facts the generator plants (RULER's QA family without its
    downloaded data sets): one fact about a person is asked, among distractor facts about other
    people (one per ``words_per_distractor`` haystack words, at least ``min_distractors``) in
    the prose haystack. Scored with ``string_match_part`` (any accepted form of the answer)."""

    name: str = "qa"
    haystack: str = "prose"
    words_per_distractor: int = 100
    min_distractors: int = 3
    max_new_tokens: int = 32
    metric: str = "string_match_part"

    def __post_init__(self) -> None:
        check_choice(self.haystack, HAYSTACK_KINDS, "haystack")
        check_positive_int(self.words_per_distractor, "words_per_distractor")
        check_positive_int(self.min_distractors, "min_distractors", allow_zero=True)
        check_positive_int(self.max_new_tokens, "max_new_tokens")

    def builder(self, seed_key: str, position: float, length: int) -> Builder:
        rng = random.Random(seed_key)
        first_names = [n for n, _ in FIRST_NAMES]
        reserved = set(prose_vocabulary())
        surnames = UniqueValues(
            rng, lambda r: _proper(r, 2) + r.choice(("s", "er", "son", "ley", "ton")), reserved
        )
        facts: list[_Fact] = []

        def take_facts(n: int) -> list[_Fact]:
            while len(facts) < n:
                person = f"{rng.choice(first_names)} {surnames.next()}"
                facts.append(_draw_fact(rng, person))
            return facts[:n]

        gold = take_facts(1)[0]
        intro = (
            "The text below mentions facts about several people. Read it carefully: a question "
            "about one of them follows.\n\n"
        )
        question = (
            "\n\nAnswer the question using only the text above. Reply with the answer only.\n"
            f"Question: {gold.question}"
        )
        stream = word_stream(self.haystack, seed_key)

        def build(units: int, fill: int) -> Draft:
            num = 1 + max(self.min_distractors, units // self.words_per_distractor)
            chosen = take_facts(num)
            depths = spread_depths(position, num)
            text = stream.render(
                units, [(d, f.statement) for d, f in zip(depths, chosen, strict=True)]
            )
            metadata = {"haystack": self.haystack, "num_facts": num, "depths": [round(position, 4)]}
            return Draft(intro + text, question, "Answer:", gold.answers, metadata)

        return Builder(build)
