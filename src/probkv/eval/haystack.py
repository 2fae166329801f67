"""Haystack text for the generated tasks (SPEC S7): license-clean, offline, seeded.

Two kinds of filler text surround the needles of the RULER-style tasks (``probkv.eval.tasks``):

- ``noise``: a short cycle of plain sentences repeated over and over (the classic
  passkey-retrieval haystack: nothing in it resembles a needle).
- ``prose``: English prose written by a small seeded grammar in this file (sentence templates
  over a hand-written vocabulary, paragraphs that follow one character), so a model reads
  varied, natural-looking text rather than repeated noise. No corpus is downloaded or shipped;
  every word comes from the lists below, which are part of probkv (Apache-2.0).

Both are exposed as a :class:`WordStream`: words (with the whitespace that follows them) and the
positions where sentences start, so a task can cut the haystack to an exact number of words and
insert needles at sentence boundaries at a chosen depth.

The prose never contains digits or hyphens, so the needles' numbers, UUIDs and
``adjective-noun`` keys cannot occur in it by accident.
"""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Callable, Iterator, Sequence

from probkv._checks import check_choice, check_positive_int

HAYSTACK_KINDS = ("noise", "prose")

# The noise cycle (own wording, in the style of the passkey-retrieval haystacks).
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The river is wide.",
    "Here we go again.",
    "The day goes on and on.",
)

# ----------------------------------------------------------------------------------------------
# Vocabulary. Plain lower-case words; no digits, no hyphens (see the module docstring).
# ----------------------------------------------------------------------------------------------

# fmt: off

FIRST_NAMES = (
    ("Anna", "she"), ("Tomas", "he"), ("Marta", "she"), ("Oskar", "he"), ("Elsa", "she"),
    ("Jonas", "he"), ("Clara", "she"), ("Henrik", "he"), ("Ida", "she"), ("Felix", "he"),
    ("Rosa", "she"), ("Anton", "he"), ("Greta", "she"), ("Emil", "he"), ("Lena", "she"),
    ("Victor", "he"), ("Nora", "she"), ("Paul", "he"), ("Hanna", "she"), ("Simon", "he"),
    ("Julia", "she"), ("Martin", "he"), ("Sofia", "she"), ("Daniel", "he"), ("Alice", "she"),
    ("Peter", "he"), ("Helen", "she"), ("Samuel", "he"), ("Mary", "she"), ("Arthur", "he"),
    ("Edith", "she"), ("Walter", "he"), ("Agnes", "she"), ("Hugo", "he"), ("Lucy", "she"),
    ("Robert", "he"), ("Eva", "she"), ("Frank", "he"), ("Irene", "she"), ("George", "he"),
    ("Olga", "she"), ("Leo", "he"), ("Vera", "she"), ("Carl", "he"), ("Ruth", "she"), ("Ben", "he"),
    ("Maud", "she"), ("Isaac", "he"), ("Tilda", "she"), ("Otto", "he"),
)

# (singular, plural) for people described by their trade or role.
ROLES = (
    ("farmer", "farmers"), ("sailor", "sailors"), ("baker", "bakers"), ("teacher", "teachers"),
    ("miller", "millers"), ("weaver", "weavers"), ("carpenter", "carpenters"),
    ("doctor", "doctors"), ("painter", "painters"), ("gardener", "gardeners"),
    ("merchant", "merchants"), ("shepherd", "shepherds"), ("fisherman", "fishermen"),
    ("traveller", "travellers"), ("student", "students"), ("neighbour", "neighbours"),
    ("stranger", "strangers"), ("musician", "musicians"), ("clerk", "clerks"), ("cook", "cooks"),
    ("blacksmith", "blacksmiths"), ("potter", "potters"), ("poet", "poets"),
    ("captain", "captains"), ("mayor", "mayors"), ("nurse", "nurses"), ("librarian", "librarians"),
    ("tailor", "tailors"), ("beekeeper", "beekeepers"), ("ferryman", "ferrymen"),
    ("innkeeper", "innkeepers"), ("glassmaker", "glassmakers"), ("watchmaker", "watchmakers"),
    ("bookbinder", "bookbinders"), ("stonemason", "stonemasons"), ("postman", "postmen"),
    ("forester", "foresters"), ("lamplighter", "lamplighters"),
)

ROLE_ADJECTIVES = (
    "old", "young", "tired", "cheerful", "quiet", "patient", "careful", "stubborn", "kind",
    "curious", "busy", "proud", "gentle", "clever", "restless", "shy", "humble", "weary",
)

# Countable things: (singular, plural).
THINGS = (
    ("basket", "baskets"), ("lantern", "lanterns"), ("letter", "letters"), ("map", "maps"),
    ("kettle", "kettles"), ("cart", "carts"), ("boat", "boats"), ("window", "windows"),
    ("ladder", "ladders"), ("barrel", "barrels"), ("blanket", "blankets"), ("bucket", "buckets"),
    ("chair", "chairs"), ("table", "tables"), ("clock", "clocks"), ("book", "books"),
    ("candle", "candles"), ("coat", "coats"), ("door", "doors"), ("fence", "fences"),
    ("gate", "gates"), ("hammer", "hammers"), ("jar", "jars"), ("key", "keys"), ("knife", "knives"),
    ("loaf", "loaves"), ("mirror", "mirrors"), ("net", "nets"), ("notebook", "notebooks"),
    ("oar", "oars"), ("pan", "pans"), ("pencil", "pencils"), ("plate", "plates"), ("rope", "ropes"),
    ("sack", "sacks"), ("scarf", "scarves"), ("shelf", "shelves"), ("shovel", "shovels"),
    ("spoon", "spoons"), ("stool", "stools"), ("trunk", "trunks"), ("umbrella", "umbrellas"),
    ("violin", "violins"), ("wagon", "wagons"), ("wheel", "wheels"), ("whistle", "whistles"),
    ("bell", "bells"), ("bottle", "bottles"), ("box", "boxes"), ("brush", "brushes"),
    ("cup", "cups"), ("drum", "drums"), ("envelope", "envelopes"), ("feather", "feathers"),
    ("flag", "flags"), ("glove", "gloves"), ("hat", "hats"), ("jug", "jugs"), ("kite", "kites"),
    ("lamp", "lamps"), ("pillow", "pillows"), ("pipe", "pipes"), ("quilt", "quilts"),
    ("ribbon", "ribbons"), ("saddle", "saddles"), ("sail", "sails"), ("stone", "stones"),
    ("teapot", "teapots"), ("tent", "tents"), ("tray", "trays"), ("vase", "vases"),
    ("compass", "compasses"), ("telescope", "telescopes"), ("apple", "apples"), ("pear", "pears"),
    ("onion", "onions"), ("cabbage", "cabbages"), ("egg", "eggs"), ("cake", "cakes"),
    ("pie", "pies"), ("shell", "shells"), ("photograph", "photographs"), ("postcard", "postcards"),
    ("recipe", "recipes"), ("song", "songs"), ("story", "stories"), ("puzzle", "puzzles"),
    ("parcel", "parcels"),
)

THING_ADJECTIVES = (
    "heavy", "small", "old", "new", "broken", "red", "blue", "green", "yellow", "grey", "white",
    "black", "round", "worn", "shiny", "dusty", "tiny", "large", "clean", "damp", "warm", "cold",
    "faded", "bright", "plain", "curious", "simple", "enormous", "borrowed", "forgotten",
    "precious", "ordinary", "familiar", "lovely", "strange", "handsome", "modest", "expensive",
    "cheap", "spare",
)

PLACES = (
    "the harbour", "the market square", "the old mill", "the river bank", "the village green",
    "the edge of the forest", "the kitchen", "the library", "the bakery", "the bridge",
    "the station", "the lighthouse", "the orchard", "the meadow", "the churchyard", "the town hall",
    "the post office", "the workshop", "the garden", "the barn", "the hilltop", "the valley",
    "the lake shore", "the inn", "the school", "the quay", "the vineyard", "the greenhouse",
    "the attic", "the cellar", "the stables", "the pier", "the old fort", "the bookshop",
    "the tea room", "the pond", "the crossroads", "the fishing village", "the mountain path",
    "the wheat field", "the city gate",
)

LANDFORMS = (
    "hills", "mountains", "moor", "cliffs", "fields", "marshes", "dunes", "forest", "ridge",
    "valley", "sea", "lake",
)

SETTLEMENTS = (
    "village", "town", "valley", "harbour town", "parish", "city", "county",
)

TIME_PHRASES = (
    "early in the morning", "after supper", "before the rain", "on the first day of spring",
    "late in the evening", "at noon", "on a grey afternoon", "just before sunrise",
    "in the middle of the night", "on the last day of autumn", "after the harvest",
    "during the long winter", "one warm summer evening", "before breakfast", "on market day",
    "the next morning", "a week later", "that same afternoon", "when the bells rang",
    "as the sun went down", "on a windy morning", "after the storm", "at the end of the month",
    "on a quiet Sunday", "soon afterwards", "some years earlier",
)

TIMES_OF_DAY = (
    "dawn", "noon", "dusk", "midnight", "the afternoon", "the evening",
)

TIME_NOUNS = (
    "morning", "evening", "afternoon", "night", "season", "week", "summer", "winter",
)

SEASONS = (
    "spring", "summer", "autumn", "winter",
)

WEEKDAYS = (
    "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
)

NUMBER_WORDS = (
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve",
)

# Verbs: (base, past). Transitive ones take a thing as object.
TRANSITIVE_VERBS = (
    ("carry", "carried"), ("mend", "mended"), ("paint", "painted"), ("find", "found"),
    ("open", "opened"), ("repair", "repaired"), ("sell", "sold"), ("buy", "bought"),
    ("clean", "cleaned"), ("polish", "polished"), ("wrap", "wrapped"), ("lift", "lifted"),
    ("fill", "filled"), ("empty", "emptied"), ("hide", "hid"), ("borrow", "borrowed"),
    ("return", "returned"), ("lose", "lost"), ("fetch", "fetched"), ("drop", "dropped"),
    ("examine", "examined"), ("measure", "measured"), ("pack", "packed"), ("load", "loaded"),
    ("move", "moved"), ("sort", "sorted"), ("count", "counted"), ("build", "built"),
    ("make", "made"), ("bring", "brought"), ("keep", "kept"), ("sweep", "swept"), ("tie", "tied"),
    ("fold", "folded"), ("decorate", "decorated"), ("inspect", "inspected"), ("weigh", "weighed"),
    ("share", "shared"), ("deliver", "delivered"), ("steady", "steadied"),
)

INTRANSITIVE_VERBS = (
    ("walk", "walked"), ("wait", "waited"), ("laugh", "laughed"), ("rest", "rested"),
    ("sing", "sang"), ("work", "worked"), ("wander", "wandered"), ("listen", "listened"),
    ("hurry", "hurried"), ("pause", "paused"), ("smile", "smiled"), ("whistle", "whistled"),
    ("read", "read"), ("sleep", "slept"), ("travel", "travelled"), ("linger", "lingered"),
    ("climb", "climbed"), ("row", "rowed"), ("dance", "danced"), ("hum", "hummed"), ("sit", "sat"),
    ("stroll", "strolled"), ("pray", "prayed"), ("write", "wrote"),
)

ADVERBS = (
    "slowly", "carefully", "quietly", "happily", "patiently", "quickly", "gently", "proudly",
    "calmly", "cheerfully", "silently", "eagerly", "nervously", "steadily", "lazily", "politely",
    "thoughtfully", "briskly", "loudly", "softly", "boldly", "wearily",
)

WEATHER = (
    ("wind", "cold", "died down"), ("rain", "heavy", "stopped"), ("fog", "thick", "lifted"),
    ("snow", "deep", "melted"), ("sun", "bright", "came out"), ("frost", "sharp", "thawed"),
    ("storm", "fierce", "passed"), ("mist", "grey", "cleared"), ("heat", "heavy", "broke"),
)

MEALS = (
    "bread and soup", "a simple breakfast", "apple pie", "a pot of tea", "fresh fish",
    "cheese and pickles", "a warm stew", "roasted chestnuts", "porridge", "honey cakes",
)

MASS_NOUNS = (
    "fresh bread", "wood smoke", "wet grass", "coffee", "salt and seaweed", "pine resin", "hot tar",
    "lavender", "new paint", "old paper", "baking apples", "cut hay",
)

TOPICS = (
    "the price of flour", "the old bridge", "the coming winter", "the harvest",
    "a journey to the coast", "the new school", "the missing goat", "the broken clock tower",
    "the summer fair", "the river flooding", "a letter from abroad", "the lighthouse lamp",
    "the best way to bake bread", "the stars", "the history of the village", "the weather",
    "the fishing season", "a wedding in the spring", "the empty house on the hill",
    "the sound of the sea", "an old family recipe", "the roads in winter", "the choir",
    "the great storm of long ago", "the migrating birds", "the cost of repairs",
)

OPINIONS = (
    "the old bridge needed repairs", "the winters were getting milder",
    "the bakery made the best bread for miles", "the harbour had never been busier",
    "the new road would bring more visitors", "the lighthouse keeper knew every ship",
    "the river was cleaner than it used to be", "the summer fair was the highlight of the year",
    "nobody played the violin like the old tailor", "the orchard gave more apples every year",
    "the school needed a new roof", "the market was too crowded on Saturdays",
)

QUOTES = (
    "We should leave before the weather turns", "I have never seen the river this high",
    "Nothing good ever comes from hurrying", "The bread will not bake itself",
    "Tomorrow will be a better day", "Mind the third step, it is loose",
    "There is always more work than daylight", "You can hear the sea from here on a quiet night",
    "Keep the lantern lit until I come back", "It is too early to tell",
    "The birds are leaving early this year", "Let us finish this before supper",
)

SENTIMENTS = (
    "a little sad", "strangely content", "hopeful", "tired but happy", "restless", "grateful",
    "worried", "at peace", "surprised", "quite proud",
)

# fmt: on


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
    """Seeded procedural English prose (SPEC S7: license-clean prose haystack).

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


def noise_sentences() -> Iterator[tuple[str, bool]]:
    """The noise haystack: ``NOISE_SENTENCES`` cycled forever, one paragraph per cycle."""
    while True:
        for k, sentence in enumerate(NOISE_SENTENCES):
            yield sentence, k == len(NOISE_SENTENCES) - 1


class WordStream:
    """A haystack cut into words, materialised lazily from a sentence iterator.

    ``words[i]`` is the i-th word and ``separators[i]`` the whitespace after it (a space, or a
    blank line at a paragraph end); ``sentence_starts`` lists the word indices where sentences
    begin. :meth:`render` cuts the haystack to ``n`` words and inserts whole sentences
    (needles) at the sentence boundary nearest to each requested depth.
    """

    def __init__(self, sentences: Iterator[tuple[str, bool]]) -> None:
        self._sentences = sentences
        self.words: list[str] = []
        self.separators: list[str] = []
        self.sentence_starts: list[int] = []

    def ensure(self, n: int) -> None:
        """Materialise at least ``n`` words."""
        while len(self.words) < n:
            sentence, ends_paragraph = next(self._sentences)
            self.sentence_starts.append(len(self.words))
            parts = sentence.split()
            self.words.extend(parts)
            self.separators.extend([" "] * (len(parts) - 1))
            self.separators.append("\n\n" if ends_paragraph else " ")

    def boundary(self, n: int, depth: float) -> int:
        """The sentence start (or ``n``, the end) in the first ``n`` words nearest to ``depth * n``."""
        self.ensure(n)
        candidates = self.sentence_starts[: bisect.bisect_right(self.sentence_starts, n - 1)]
        candidates = [*candidates, n] if n > 0 else [0]
        target = depth * n
        i = bisect.bisect_left(candidates, target)
        best = min(candidates[max(i - 1, 0) : i + 1], key=lambda b: (abs(b - target), b))
        return best

    def render(self, n: int, insertions: Sequence[tuple[float, str]] = ()) -> str:
        """The first ``n`` words with each ``(depth, sentence)`` of ``insertions`` placed at the
        sentence boundary nearest to ``depth * n`` (depth in [0, 1]; 0 = start, 1 = end).
        Insertions that land on the same boundary keep their order in ``insertions``."""
        check_positive_int(n, "n", allow_zero=True)
        self.ensure(n)
        at: dict[int, list[str]] = {}
        for depth, text in insertions:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"insertion depth must be in [0, 1], got {depth!r}")
            at.setdefault(self.boundary(n, depth), []).append(text)
        out: list[str] = []
        for i in range(n):
            out.extend(text + " " for text in at.get(i, ()))
            out.append(self.words[i] + (self.separators[i] if i < n - 1 else ""))
        if at.get(n) and n > 0:
            out.append(" " + " ".join(at[n]))
        elif n == 0:
            out = [" ".join(at.get(0, ()))]
        return "".join(out).strip()


def word_stream(kind: str, seed: int | str) -> WordStream:
    """A :class:`WordStream` over the ``noise`` or seeded ``prose`` haystack."""
    check_choice(kind, HAYSTACK_KINDS, "haystack")
    if kind == "noise":
        return WordStream(noise_sentences())
    return WordStream(ProseGenerator(seed).sentences())


@functools.cache
def prose_vocabulary() -> tuple[str, ...]:
    """Distinct lower-case single words of the prose vocabulary (used as word pools by tasks)."""
    words: set[str] = set()
    for group in (ROLES, THINGS, TRANSITIVE_VERBS, INTRANSITIVE_VERBS):
        for pair in group:
            words.update(pair)
    for group in (ROLE_ADJECTIVES, THING_ADJECTIVES, ADVERBS, LANDFORMS, SEASONS, NUMBER_WORDS):
        words.update(group)
    return tuple(sorted(w for w in words if w.isalpha() and w.islower()))
