"""The words of the prose haystack (S7): hand-written lists, part of probkv (Apache-2.0).

Plain lower-case words (names and weekdays capitalised); no digits, no hyphens, so the
needles' numbers, UUIDs and ``adjective-noun`` keys cannot occur in the prose by accident.
The task generators also draw keys and word pools from these lists.
"""

from __future__ import annotations

import functools

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
