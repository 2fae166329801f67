"""Seeded procedural English prose (S7): the ``prose`` haystack.

Sentence templates over the hand-written vocabulary (:mod:`.vocabulary`), in paragraphs that
follow one character, so a model reads varied, natural-looking text rather than repeated
noise. No corpus is downloaded or shipped.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

from probkv.eval.haystack.vocabulary import (
    ADVERBS,
    FIRST_NAMES,
    INTRANSITIVE_VERBS,
    LANDFORMS,
    MASS_NOUNS,
    MEALS,
    NUMBER_WORDS,
    OPINIONS,
    PLACES,
    QUOTES,
    ROLE_ADJECTIVES,
    ROLES,
    SEASONS,
    SENTIMENTS,
    SETTLEMENTS,
    THING_ADJECTIVES,
    THINGS,
    TIME_NOUNS,
    TIME_PHRASES,
    TIMES_OF_DAY,
    TOPICS,
    TRANSITIVE_VERBS,
    WEATHER,
    WEEKDAYS,
)


def _article(word: str) -> str:
    """English indefinite article for the word that follows (the vocabulary avoids exceptions)."""
    return "an" if word[0].lower() in "aeiou" else "a"


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


class _Character:
    """The person a paragraph follows: a named person or a role, with matching pronouns."""

    def __init__(self, rng: random.Random) -> None:
        if rng.random() < 0.5:
            name, pronoun = rng.choice(FIRST_NAMES)
            self.full = name
            self.short = name
        else:
            role, _ = rng.choice(ROLES)
            adjective = rng.choice(ROLE_ADJECTIVES)
            pronoun = rng.choice(("she", "he"))
            self.full = f"the {adjective} {role}"
            self.short = f"the {role}"
        self.subject = pronoun
        self.object = "her" if pronoun == "she" else "him"
        self.possessive = "her" if pronoun == "she" else "his"


class ProseGenerator:
    """Seeded procedural English prose (S7: license-clean prose haystack).

    ``sentences()`` yields ``(sentence, ends_paragraph)`` forever. Paragraphs have 3 to 7
    sentences and follow one character, introduced by name or role and then referred to by
    pronoun. The same seed always yields the same text.
    """

    def __init__(self, seed: int | str) -> None:
        self._rng = random.Random(f"probkv-prose:{seed}")
        self._templates: tuple[Callable[[_Character], str], ...] = (
            self._s_time_action,
            self._s_walk,
            self._s_weather,
            self._s_remember,
            self._s_wanted,
            self._s_forgotten,
            self._s_quote,
            self._s_kind_of_time,
            self._s_counted,
            self._s_view,
            self._s_belonged,
            self._s_later,
            self._s_smell,
            self._s_weekday,
            self._s_there_were,
            self._s_when_weather,
            self._s_wrote,
            self._s_singing,
            self._s_road,
            self._s_adverb_action,
            self._s_full_of,
            self._s_thought,
            self._s_wind,
            self._s_promised,
            self._s_decided,
            self._s_shared_meal,
            self._s_opinion,
            self._s_felt,
            self._s_asked,
            self._s_visitor,
        )

    # --- slot fillers -------------------------------------------------------------------------
    def _thing(self, *, definite: bool = False) -> str:
        singular, _ = self._rng.choice(THINGS)
        adjective = self._rng.choice(THING_ADJECTIVES)
        if definite:
            return f"the {adjective} {singular}"
        return f"{_article(adjective)} {adjective} {singular}"

    def _plural(self) -> str:
        return self._rng.choice(THINGS)[1]

    def _person(self) -> str:
        r = self._rng.random()
        if r < 0.4:
            return self._rng.choice(FIRST_NAMES)[0]
        role = self._rng.choice(ROLES)[0]
        if r < 0.7:
            return f"the {role}"
        adjective = self._rng.choice(ROLE_ADJECTIVES)
        return f"{_article(adjective)} {adjective} {role}"

    def _pick(self, options: Sequence[str]) -> str:
        return self._rng.choice(options)

    # --- sentence templates (each takes the paragraph's character) ---------------------------
    def _s_time_action(self, c: _Character) -> str:
        verb = self._rng.choice(TRANSITIVE_VERBS)[1]
        return f"{_cap(self._pick(TIME_PHRASES))}, {c.subject} {verb} {self._thing()} near {self._pick(PLACES)}."

    def _s_walk(self, c: _Character) -> str:
        verb = self._rng.choice(INTRANSITIVE_VERBS)[1]
        return f"{_cap(c.subject)} {verb} {self._pick(ADVERBS)} by {self._pick(PLACES)}."

    def _s_weather(self, c: _Character) -> str:
        noun, adjective, _ = self._rng.choice(WEATHER)
        verb = self._rng.choice(INTRANSITIVE_VERBS)[1]
        return f"The {noun} was {adjective} that {self._pick(SEASONS)}, but {c.subject} {verb} all the same."

    def _s_remember(self, c: _Character) -> str:
        adjective = self._pick(("quiet", "wet", "busy", "long", "strange", "gentle", "hard"))
        return f"Nobody in the {self._pick(SETTLEMENTS)} could remember {_article(adjective)} {adjective} {self._pick(SEASONS)} like that one."

    def _s_wanted(self, c: _Character) -> str:
        verb = self._rng.choice(TRANSITIVE_VERBS)[0]
        return f"{_cap(c.subject)} had always wanted to {verb} {self._thing()}, but there was never enough time."

    def _s_forgotten(self, c: _Character) -> str:
        return f"Beside {self._pick(PLACES)}, {self._thing()} lay forgotten under a pile of {self._plural()}."

    def _s_quote(self, c: _Character) -> str:
        speaker = c.short if self._rng.random() < 0.5 else self._person()
        return f'"{self._pick(QUOTES)}," said {speaker}.'

    def _s_kind_of_time(self, c: _Character) -> str:
        verb = self._rng.choice(INTRANSITIVE_VERBS)[1]
        roles = self._rng.choice(ROLES)[1]
        return f"It was the kind of {self._pick(TIME_NOUNS)} when {roles} {verb} {self._pick(ADVERBS)} along {self._pick(PLACES)}."

    def _s_counted(self, c: _Character) -> str:
        return f"{_cap(c.short)} counted the {self._plural()} twice and found {self._pick(NUMBER_WORDS)} more than {c.subject} had expected."

    def _s_view(self, c: _Character) -> str:
        first, second = self._rng.sample(PLACES, 2)
        return f"From {first} one could see {self._thing()} and, further off, {second}."

    def _s_belonged(self, c: _Character) -> str:
        verb = self._rng.choice(TRANSITIVE_VERBS)[1]
        return f"{_cap(self._thing(definite=True))} that {c.subject} {verb} had belonged to {self._person()} for many years."

    def _s_later(self, c: _Character) -> str:
        (_, v1), (_, v2) = self._rng.sample(TRANSITIVE_VERBS, 2)
        return f"Later, {c.subject} {v1} {self._thing()} and {v2} {self._thing()}."

    def _s_smell(self, c: _Character) -> str:
        return f"{_cap(c.short)} liked the smell of {self._pick(MASS_NOUNS)} in the {self._pick(TIME_NOUNS)}."

    def _s_weekday(self, c: _Character) -> str:
        verb = self._rng.choice(INTRANSITIVE_VERBS)[1]
        return f"Every {self._pick(WEEKDAYS)}, {c.subject} {verb} at {self._pick(PLACES)} with {self._thing()}."

    def _s_there_were(self, c: _Character) -> str:
        a1, a2 = self._rng.sample(THING_ADJECTIVES, 2)
        return f"There were {self._pick(NUMBER_WORDS)} {self._plural()} on the {self._pick(('table', 'shelf', 'windowsill', 'cart', 'floor', 'bench'))}, each one {a1} and {a2}."

    def _s_when_weather(self, c: _Character) -> str:
        noun, _, verb = self._rng.choice(WEATHER)
        roles = self._rng.choice(ROLES)[1]
        verb_i = self._rng.choice(INTRANSITIVE_VERBS)[1]
        return f"When the {noun} finally {verb}, the {roles} {verb_i} {self._pick(ADVERBS)}."

    def _s_wrote(self, c: _Character) -> str:
        return (
            f"{_cap(c.short)} wrote a long letter to {self._person()} about {self._pick(TOPICS)}."
        )

    def _s_singing(self, c: _Character) -> str:
        return f"Somewhere near {self._pick(PLACES)}, {self._person()} was singing an old song about {self._pick(TOPICS)}."

    def _s_road(self, c: _Character) -> str:
        a1, a2 = self._rng.sample(THING_ADJECTIVES, 2)
        return f"The road to {self._pick(PLACES)} was {self._pick(('long', 'muddy', 'steep', 'narrow', 'quiet', 'dusty'))}, and the {self._plural()} along it were {a1} and {a2}."

    def _s_adverb_action(self, c: _Character) -> str:
        verb = self._rng.choice(TRANSITIVE_VERBS)[1]
        return f"{_cap(c.subject)} {self._pick(ADVERBS)} {verb} {self._thing()}, then sat down to rest."

    def _s_full_of(self, c: _Character) -> str:
        (_, p1), (_, p2) = self._rng.sample(ROLES, 2)
        return f"By {self._pick(TIMES_OF_DAY)}, {self._pick(PLACES)} was full of {p1} and {p2}."

    def _s_thought(self, c: _Character) -> str:
        return f"{_cap(c.short)} thought about {self._pick(TOPICS)} for a long while."

    def _s_wind(self, c: _Character) -> str:
        adjective = self._pick(("cold", "warm", "salty", "gusty", "gentle", "bitter"))
        return f"{_cap(_article(adjective))} {adjective} wind came down from the {self._pick(LANDFORMS)} and rattled the {self._plural()}."

    def _s_promised(self, c: _Character) -> str:
        verb = self._rng.choice(TRANSITIVE_VERBS)[0]
        return f"{_cap(c.subject)} promised {self._person()} to {verb} {self._thing(definite=True)} before {self._pick(SEASONS)}."

    def _s_decided(self, c: _Character) -> str:
        return f"In the end, {c.subject} decided that {self._pick(TOPICS)} could wait until {self._pick(SEASONS)}."

    def _s_shared_meal(self, c: _Character) -> str:
        return f"{_cap(c.short)} and {self._person()} shared {self._pick(MEALS)} at {self._pick(PLACES)}."

    def _s_opinion(self, c: _Character) -> str:
        return f"Most people in the {self._pick(SETTLEMENTS)} agreed that {self._pick(OPINIONS)}."

    def _s_felt(self, c: _Character) -> str:
        return f"For a moment {c.subject} felt {self._pick(SENTIMENTS)}, and {c.possessive} thoughts drifted to {self._pick(TOPICS)}."

    def _s_asked(self, c: _Character) -> str:
        return f"{_cap(self._person())} asked {c.object} whether {self._thing(definite=True)} was still at {self._pick(PLACES)}."

    def _s_visitor(self, c: _Character) -> str:
        return f"{_cap(self._pick(TIME_PHRASES))}, {self._person()} came by with {self._thing()} and news about {self._pick(TOPICS)}."

    # --- paragraphs ---------------------------------------------------------------------------
    def _opening(self, c: _Character) -> str:
        verb = self._rng.choice(TRANSITIVE_VERBS)[1]
        place = self._pick(PLACES)
        if self._rng.random() < 0.5:
            return f"{_cap(self._pick(TIME_PHRASES))}, {c.full} {verb} {self._thing()} at {place}."
        verb_i = self._rng.choice(INTRANSITIVE_VERBS)[1]
        return f"{_cap(c.full)} {verb_i} {self._pick(ADVERBS)} to {place}."

    def sentences(self) -> Iterator[tuple[str, bool]]:
        """Yield ``(sentence, ends_paragraph)`` forever."""
        rng = self._rng
        while True:
            character = _Character(rng)
            count = rng.randint(3, 7)
            yield self._opening(character), False
            previous = None
            for k in range(1, count):
                template = rng.choice(self._templates)
                while template is previous:  # no template twice in a row
                    template = rng.choice(self._templates)
                previous = template
                yield template(character), k == count - 1
