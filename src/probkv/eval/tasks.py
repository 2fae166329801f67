"""RULER-style synthetic tasks, generated offline, seeded and fitted to a token length (SPEC S7).

``generate_examples(task, tokenizer=..., length=..., num_examples=..., seed=...)`` returns
:class:`~probkv.eval.examples.Example` records whose prompt length (chat template overhead +
context + question + answer prefix, as defined in :mod:`probkv.eval.prompt`) is within 2% of
``length`` and never above it. The haystack grows word by word (or needle by needle, topped
up with noise words) until it fills the budget; a binary search on the real tokenizer finds
the size.

Tasks (RULER's families, as far as they can be made without downloads):

========================  ===========================================================  ======
name                      what                                                         metric
========================  ===========================================================  ======
``niah_single_1``         noise haystack, one word key, a 7-digit number               all
``niah_single_2``         prose haystack, one word key, a 7-digit number               all
``niah_single_3``         prose haystack, one word key, a UUID value                   all
``niah_multikey_1``       prose haystack, 4 keys planted, one asked                    all
``niah_multikey_2``       haystack made of distractor needles (word keys, numbers)     all
``niah_multikey_3``       haystack of UUID-key/UUID-value distractor needles           all
``niah_multivalue``       prose haystack, one key with 4 values, all asked             all
``niah_multiquery``       prose haystack, 4 keys, all asked                            all
``vt``                    variable-assignment chains (4 hops) among distractor chains  all
``cwe``                   10 common words in a numbered list of rarer words            all
``fwe``                   3 most frequent coded words, Zipf-like frequencies           all
``qa``                    a fact about a person among distractor facts in prose         part
========================  ===========================================================  ======

(all = ``string_match_all``, part = ``string_match_part``, as RULER scores them.)

Depth: within an example the planted items are spread evenly over the context (a random
rotation); across examples the depth of the asked needle follows a golden-ratio sequence
from a seeded start, so any number of examples covers depths evenly. Every example is a
pure function of ``(task, length, seed, index)`` and the tokenizer.
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from probkv._checks import check_choice, check_positive_int
from probkv.eval import haystack as hs
from probkv.eval.examples import Example
from probkv.eval.prompt import prompt_length

LENGTH_TOLERANCE = 0.02  # generated prompts are in [(1 - 2%) * length, length] tokens
_GOLDEN = 0.6180339887498949  # fractional part of the golden ratio (low-discrepancy depths)
_MAX_UNITS = 10_000_000

KEY_KINDS = ("words", "numbers", "uuids")
NEEDLE_HAYSTACKS = ("noise", "prose", "needles")


@dataclass(frozen=True)
class Draft:
    """A generated prompt before tokenization: context, question, answer prefix, answers."""

    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Builder:
    """One example's generator: ``draft(units, fill)`` is the prompt with a haystack of
    ``units`` units (words, distractor needles or list entries, depending on the task) and
    ``fill`` extra noise words; ``fill_capacity`` is the most fill words it accepts (0: none).
    A draft is a deterministic function of ``(units, fill)``; its length grows with both."""

    draft: Callable[[int, int], Draft]
    fill_capacity: int = 0


class _Unique:
    """Draws distinct values of one kind from a seeded stream (prefix-stable: the k-th value
    does not depend on how many are drawn)."""

    def __init__(
        self,
        rng: random.Random,
        draw: Callable[[random.Random], str],
        used: set[str],
        reject: Callable[[str], bool] | None = None,
    ):
        self._rng, self._draw, self._used, self._reject = rng, draw, used, reject
        self.values: list[str] = []

    def next(self) -> str:
        """Draw the next distinct value."""
        for _ in range(10_000):
            value = self._draw(self._rng)
            if value not in self._used and not (self._reject and self._reject(value)):
                self._used.add(value)
                self.values.append(value)
                return value
        raise ValueError(
            f"ran out of distinct values after {len(self.values)}; use a shorter length"
        )

    def take(self, n: int) -> list[str]:
        """The first ``n`` values (drawing more as needed)."""
        while len(self.values) < n:
            self.next()
        return self.values[:n]


_KEY_ADJECTIVES = tuple(sorted(set(hs.THING_ADJECTIVES) | set(hs.ROLE_ADJECTIVES)))
_KEY_NOUNS = tuple(sorted({t for t, _ in hs.THINGS} | {r for r, _ in hs.ROLES}))


def _draw_word_key(rng: random.Random) -> str:
    return f"{rng.choice(_KEY_ADJECTIVES)}-{rng.choice(_KEY_NOUNS)}"


def _draw_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _draw_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


_DRAW = {"words": _draw_word_key, "numbers": _draw_number, "uuids": _draw_uuid}
_KIND_NAMES = {
    "words": ("word", "words"),
    "numbers": ("number", "numbers"),
    "uuids": ("uuid", "uuids"),
}

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _pseudo_word(rng: random.Random, syllables: int = 2) -> str:
    """A pronounceable made-up word: consonant-vowel syllables and a final consonant (CVCVC)."""
    parts = [rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return "".join(parts) + rng.choice(_CONSONANTS)


def _occurs_in(text: str) -> Callable[[str], bool]:
    """Predicate: does a candidate answer occur in ``text`` (case-insensitive)? Answers must not
    occur in the question or answer prefix, or echoing the prompt would score (S7 scorers
    match substrings)."""
    lowered = text.lower()
    return lambda candidate: candidate.lower() in lowered


def _spread_depths(position: float, count: int) -> list[float]:
    """``count`` depths evenly spaced over [0, 1), the first one at ``position``."""
    return [(position + j / count) % 1.0 for j in range(count)]


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


# ----------------------------------------------------------------------------------------------
# Needle in a haystack
# ----------------------------------------------------------------------------------------------


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
        keys = _Unique(rng, _DRAW[self.key_kind], used).take(self.num_keys)
        asked = keys[: self.num_queries]
        num_planted = self.num_queries * self.num_values + self.num_keys - self.num_queries
        values = iter(_Unique(rng, _DRAW[self.value_kind], used).take(num_planted))
        # Asked keys first (``num_values`` needles each), then one needle per distractor key.
        planted = [(key, next(values)) for key in asked for _ in range(self.num_values)]
        planted += [(key, next(values)) for key in keys[self.num_queries :]]
        answers = tuple(v for k, v in planted if k in asked)
        # The first asked needle sits at ``position``; the others take the remaining slots.
        depths = _spread_depths(position, len(planted))
        rest = depths[1:]
        rng.shuffle(rest)
        depths = [depths[0], *rest]

        kind, kinds = _KIND_NAMES[self.value_kind]
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

        if self.haystack in hs.HAYSTACK_KINDS:
            stream = hs.word_stream(self.haystack, seed_key)

            def build(units: int, fill: int) -> Draft:
                text = stream.render(units, list(zip(depths, planted_text, strict=True)))
                return Draft(intro + text, question, prefix, answers, metadata)

            return Builder(build)

        # Haystack of distractor needles, with its own key/value streams (prefix-stable).
        d_keys = _Unique(random.Random(seed_key + ":keys"), _DRAW[self.key_kind], used)
        d_values = _Unique(random.Random(seed_key + ":values"), _DRAW[self.value_kind], used)
        noise = hs.word_stream("noise", seed_key)

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


# ----------------------------------------------------------------------------------------------
# Variable tracking
# ----------------------------------------------------------------------------------------------


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
        check_choice(self.haystack, hs.HAYSTACK_KINDS, "haystack")

    def builder(self, seed_key: str, position: float, length: int) -> Builder:
        rng = random.Random(seed_key)
        question_template = (
            "\n\nQuestion: Which variables are assigned the value {value}, directly or through a "
            "chain of assignments, in the text above? List all of them."
        )
        prefix_template = "Answer: The variables that are assigned the value {value} are:"
        reserved = {w.upper() for w in hs.prose_vocabulary()}
        names = _Unique(
            rng, _draw_variable, reserved, _occurs_in(question_template + prefix_template)
        ).take(self.num_chains * (self.num_hops + 1))
        values = _Unique(rng, lambda r: str(r.randint(10_000, 99_999)), set()).take(self.num_chains)
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
        depths = sorted(_spread_depths(position, len(sequence)))
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
        stream = hs.word_stream(self.haystack, seed_key)

        def build(units: int, fill: int) -> Draft:
            text = stream.render(units, list(zip(depths, sequence, strict=True)))
            return Draft(intro + text, question, prefix, answers, metadata)

        return Builder(build)


# ----------------------------------------------------------------------------------------------
# Common and frequent words
# ----------------------------------------------------------------------------------------------


class _WordPool:
    """A prefix-stable sequence of distinct words: the prose vocabulary shuffled, then made-up
    words (CVCVC) once the vocabulary runs out."""

    def __init__(self, rng: random.Random) -> None:
        self.words = list(hs.prose_vocabulary())
        rng.shuffle(self.words)
        self._extra = _Unique(rng, _pseudo_word, set(self.words))

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
        in_prompt = _occurs_in(intro + question + prefix)
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


@dataclass(frozen=True)
class FrequentWordsTask:
    """RULER frequent words extraction: a text of made-up "coded" words whose frequencies
    follow a Zipf law ``p(k) ∝ k^-alpha`` over ``vocab_size`` words; name the ``num_top`` most
    frequent. Counts are ``round(n p(k))`` for a text of about ``n`` words, so the ranking is
    exact (the top words are strictly more frequent than the rest), then the words are shuffled."""

    name: str = "fwe"
    num_top: int = 3
    alpha: float = 2.0
    vocab_size: int = 200
    min_words: int = 40
    max_new_tokens: int = 32
    metric: str = "string_match_all"

    def __post_init__(self) -> None:
        check_positive_int(self.num_top, "num_top")
        check_positive_int(self.vocab_size, "vocab_size")
        check_positive_int(self.max_new_tokens, "max_new_tokens")
        if self.vocab_size <= self.num_top:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be > num_top ({self.num_top})")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")

    def builder(self, seed_key: str, position: float, length: int) -> Builder:
        rng = random.Random(seed_key)
        intro = (
            "The text below is written in a code of made-up words. Keep count of how often each "
            "coded word appears.\n\n"
        )
        question = (
            f"\n\nQuestion: Which {self.num_top} coded words appear most often in the text above? "
            "Reply with the words only."
        )
        prefix = f"Answer: The {self.num_top} most frequent coded words in the text above are:"
        in_prompt = _occurs_in(intro + question + prefix)
        # Made-up words of equal length: none is a substring of another.
        vocab = _Unique(
            rng, lambda r: _pseudo_word(r, 2), set(hs.prose_vocabulary()), in_prompt
        ).take(self.vocab_size)
        weights = [(k + 1) ** -self.alpha for k in range(self.vocab_size)]
        total = sum(weights)
        probs = [w / total for w in weights]
        top = tuple(vocab[: self.num_top])

        def build(units: int, fill: int) -> Draft:
            n = units + self.min_words
            counts = [round(n * p) for p in probs]
            if counts[self.num_top - 1] <= counts[self.num_top]:
                raise ValueError(f"fwe: {n} words are too few to rank the top {self.num_top}")
            words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
            random.Random(f"{seed_key}:order:{units}").shuffle(words)
            metadata = {"alpha": self.alpha, "counts": counts[: self.num_top + 1]}
            return Draft(intro + " ".join(words), question, prefix, top, metadata)

        return Builder(build)


# ----------------------------------------------------------------------------------------------
# Question answering over planted facts
# ----------------------------------------------------------------------------------------------

_TOWN_SUFFIXES = ("wick", "moor", "ford", "holm", "stead", "bury", "dale", "mere", "by", "thorpe")
_BOAT_WORDS = (
    ("Silver", "Golden", "Morning", "Evening", "Northern", "Quiet", "Swift", "Little", "Bold"),
    ("Heron", "Swallow", "Tern", "Otter", "Lark", "Falcon", "Petrel", "Wren", "Seal", "Gannet"),
)
_ANIMALS = ("dog", "cat", "parrot", "goat", "pony", "tortoise", "rabbit", "donkey", "goose")


def _proper(rng: random.Random, syllables: int) -> str:
    return _pseudo_word(rng, syllables).capitalize()


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
        check_choice(self.haystack, hs.HAYSTACK_KINDS, "haystack")
        check_positive_int(self.words_per_distractor, "words_per_distractor")
        check_positive_int(self.min_distractors, "min_distractors", allow_zero=True)
        check_positive_int(self.max_new_tokens, "max_new_tokens")

    def builder(self, seed_key: str, position: float, length: int) -> Builder:
        rng = random.Random(seed_key)
        first_names = [n for n, _ in hs.FIRST_NAMES]
        reserved = set(hs.prose_vocabulary())
        surnames = _Unique(
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
        stream = hs.word_stream(self.haystack, seed_key)

        def build(units: int, fill: int) -> Draft:
            num = 1 + max(self.min_distractors, units // self.words_per_distractor)
            chosen = take_facts(num)
            depths = _spread_depths(position, num)
            text = stream.render(
                units, [(d, f.statement) for d, f in zip(depths, chosen, strict=True)]
            )
            metadata = {"haystack": self.haystack, "num_facts": num, "depths": [round(position, 4)]}
            return Draft(intro + text, question, "Answer:", gold.answers, metadata)

        return Builder(build)


Task = NeedleTask | VariableTrackingTask | CommonWordsTask | FrequentWordsTask | FactQATask

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        NeedleTask("niah_single_1", "noise"),
        NeedleTask("niah_single_2", "prose"),
        NeedleTask("niah_single_3", "prose", value_kind="uuids", max_new_tokens=48),
        NeedleTask("niah_multikey_1", "prose", num_keys=4),
        NeedleTask("niah_multikey_2", "needles"),
        NeedleTask(
            "niah_multikey_3", "needles", key_kind="uuids", value_kind="uuids", max_new_tokens=48
        ),
        NeedleTask("niah_multivalue", "prose", num_values=4, max_new_tokens=64),
        NeedleTask("niah_multiquery", "prose", num_keys=4, num_queries=4, max_new_tokens=64),
        VariableTrackingTask(),
        CommonWordsTask(),
        FrequentWordsTask(),
        FactQATask(),
    )
}
"""The generated tasks by name (SPEC S7)."""

TASK_NAMES = tuple(TASKS)


def get_task(task: str | Task) -> Task:
    """A task by name (see :data:`TASKS`), or a task object as is."""
    if isinstance(task, str):
        return TASKS[check_choice(task, TASK_NAMES, "task")]
    if isinstance(
        task, (NeedleTask, VariableTrackingTask, CommonWordsTask, FrequentWordsTask, FactQATask)
    ):
        return task
    raise ValueError(
        f"task must be a task name ({', '.join(TASK_NAMES)}) or a task object, got {task!r}"
    )


def _fit(spec: Task, build: Builder, tokenizer: Any, length: int, example_id: str) -> Example:
    """The largest haystack whose prompt is at most ``length`` tokens (binary search on the
    real tokenizer), topped up with fill words where the task allows them."""

    def measure(units: int, fill: int) -> tuple[int, Example]:
        draft = build.draft(units, fill)
        example = Example(
            id=example_id,
            task=spec.name,
            context=draft.context,
            question=draft.question,
            answers=draft.answers,
            max_new_tokens=spec.max_new_tokens,
            metric=spec.metric,
            answer_prefix=draft.answer_prefix,
            metadata=draft.metadata,
        )
        return prompt_length(example, tokenizer), example

    def largest(
        fits_at: Callable[[int], tuple[int, Example]],
        known: tuple[int, int, Example],
        hi: int | None,
    ) -> tuple[int, int, Example]:
        """Largest ``x < hi`` with ``fits_at(x)[0] <= length``, from a ``known`` fitting
        ``(x, tokens, example)``; ``hi=None`` searches upwards exponentially first."""
        lo, lo_n, lo_ex = known
        step = 16
        while hi is None:
            probe = lo + step
            n, ex = fits_at(probe)
            if n > length:
                hi = probe
            else:
                lo, lo_n, lo_ex = probe, n, ex
                step *= 2
                if lo > _MAX_UNITS:
                    raise ValueError(f"task {spec.name!r} cannot reach length={length}")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            n, ex = fits_at(mid)
            if n <= length:
                lo, lo_n, lo_ex = mid, n, ex
            else:
                hi = mid
        return lo, lo_n, lo_ex

    n, example = measure(0, 0)
    if n > length:
        raise ValueError(
            f"length={length} is too small for task {spec.name!r}: its prompt without haystack "
            f"already takes {n} tokens"
        )
    units, n, example = largest(lambda u: measure(u, 0), (0, n, example), None)
    if build.fill_capacity and n < length:
        fit = largest(lambda f: measure(units, f), (0, n, example), build.fill_capacity + 1)
        _, n, example = fit
    if n < (1.0 - LENGTH_TOLERANCE) * length:
        raise ValueError(
            f"task {spec.name!r} could not be fitted to length={length} within "
            f"{LENGTH_TOLERANCE:.0%} (closest: {n} tokens); use a larger length"
        )
    return replace(example, metadata={**example.metadata, "length": length, "prompt_tokens": n})


def generate_examples(
    task: str | Task,
    *,
    tokenizer: Any,
    length: int,
    num_examples: int,
    seed: int = 0,
) -> list[Example]:
    """Generate ``num_examples`` examples of ``task`` whose prompts fit ``length`` tokens.

    Args:
        task: a name from :data:`TASK_NAMES` or a task object (e.g. a custom ``NeedleTask``).
        tokenizer: a transformers tokenizer (or any object with ``encode(text,
            add_special_tokens=...)`` and optionally ``chat_template``/``apply_chat_template``).
        length: target prompt length in tokens, as defined by
            :func:`probkv.eval.prompt.prompt_length` (chat template + context + question +
            answer prefix); every prompt has between ``0.98 * length`` and ``length`` tokens.
        num_examples: how many examples (ids ``<task>-<length>-<seed>-<index>``).
        seed: the same seed (with the same task, length and tokenizer) gives the same examples.
    """
    spec = get_task(task)
    check_positive_int(length, "length")
    check_positive_int(num_examples, "num_examples")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    start = random.Random(f"probkv-depth:{spec.name}:{seed}").random()
    examples = []
    for index in range(num_examples):
        position = (start + index * _GOLDEN) % 1.0
        seed_key = f"probkv:{spec.name}:{length}:{seed}:{index}"
        build = spec.builder(seed_key, position, length)
        example_id = f"{spec.name}-{length}-{seed}-{index}"
        examples.append(_fit(spec, build, tokenizer, length, example_id))
    return examples


def task_metric(task: str) -> str | None:
    """The scorer of a generated task name, or None for other names."""
    spec = TASKS.get(task)
    return None if spec is None else spec.metric


__all__ = [
    "LENGTH_TOLERANCE",
    "TASKS",
    "TASK_NAMES",
    "CommonWordsTask",
    "Draft",
    "FactQATask",
    "FrequentWordsTask",
    "NeedleTask",
    "VariableTrackingTask",
    "generate_examples",
    "get_task",
    "task_metric",
]
