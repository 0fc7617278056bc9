"""Slot fillers of the offline story generator (:mod:`data.stories`): names, animals, places, objects, feelings."""


def _rows(table: str) -> tuple[tuple[str, ...], ...]:
    """The rows of a text table, one a line, cells between ``|`` (white space around them dropped)."""
    return tuple(tuple(cell.strip() for cell in line.split("|")) for line in table.strip().splitlines())


def _objects(table: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``object | adjective adjective ...`` rows: each object with its adjective choices."""
    return tuple((thing, tuple(adjs.split())) for thing, adjs in _rows(table))


# --------------------------------------------------------------------------------------------------------------------
# Slot fillers
# --------------------------------------------------------------------------------------------------------------------
# fmt: off
GIRL_NAMES = (
    "Lily", "Mia", "Sue", "Anna", "Emma", "Zoe", "Ruby", "Lucy", "Daisy", "Ella", "Molly", "Rose", "Amy", "Kim",
    "Sara", "Nina", "Lola", "Jane", "Ivy", "Maya", "Grace", "Hannah", "Chloe", "Sophie",
)
BOY_NAMES = (
    "Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Oliver", "Jake", "Bob", "Noah", "Theo", "Luke",
    "Eli", "Dan", "Peter", "Jimmy", "Henry", "Oscar", "Adam", "Mark", "Billy", "Joe",
)
PET_NAMES = (
    "Spot", "Fluffy", "Whiskers", "Pip", "Bella", "Coco", "Buddy", "Rex", "Sunny", "Tweet", "Hoppy", "Benny",
    "Mittens", "Daisy", "Bubbles", "Patch", "Ziggy", "Nutmeg", "Pebble", "Rusty", "Honey", "Snowy",
)
ANIMALS = (
    "cat", "dog", "bunny", "bear", "fox", "duck", "mouse", "frog", "bird", "puppy", "kitten", "owl", "squirrel",
    "turtle", "pig", "lamb", "horse", "monkey",
)
TRAITS = (
    "kind", "happy", "curious", "brave", "shy", "little", "silly", "friendly", "clever", "gentle", "playful",
    "cheerful",
)
# place | a feature of the place | a high spot | a hiding spot
PLACES = _rows("""
    park       | a big slide               | the tall oak tree     | the bench
    garden     | many pretty flowers       | the apple tree        | the bushes
    forest     | tall green trees          | a high branch         | a pile of leaves
    beach      | soft warm sand            | the top of a big rock | a sand castle
    farm       | a red barn                | the roof of the barn  | the hay
    backyard   | a little swing            | the fence             | the flower pot
    playground | a tall climbing frame     | the top of the slide  | the sandbox
    meadow     | yellow flowers everywhere | a tall tree           | the long grass
    lake       | quiet blue water          | a tree by the water   | the reeds
    village    | small colorful houses     | a rooftop             | a wooden cart
    zoo        | many funny animals        | a high wall           | a big basket
    hill       | a great view of the town  | a lonely tree         | a big stone
""")
# object | adjective choices
OBJECTS = _objects("""
    ball       | red bouncy big blue shiny
    kite       | colorful red long yellow
    teddy bear | soft brown old fluffy
    toy car    | fast red little shiny
    hat        | green funny big warm
    book       | new big old colorful
    balloon    | red blue big round
    doll       | pretty little old soft
    shell      | pink shiny small smooth
    boat       | little wooden blue paper
    drum       | loud red little new
    blanket    | warm soft blue striped
    necklace   | shiny gold pretty sparkly
    crayon     | purple green long bright
    puzzle     | big new hard colorful
    cup        | blue little pretty special
""")
HIGH_OBJECTS = ("kite", "ball", "balloon", "hat")  # things that can get stuck up high
FOODS = ("cookies", "a cake", "pancakes", "a pie", "muffins", "soup", "sandwiches", "a fruit salad")
ACTIVITIES = (
    "play outside", "run and jump", "draw pictures", "sing songs", "dance", "read books", "build towers",
    "look at the clouds", "swim", "pick flowers", "play games", "climb trees",
)
# scary thing | what makes it less scary
SCARY_THINGS = _rows("""
    the dark         | the night light
    the loud thunder | the warm blanket
    the big waves    | the sand
    the tall slide   | the ladder
    the buzzing bees | the flowers
    the deep water   | the shallow part
""")
WEATHER = ("sunny", "warm", "windy", "cloudy", "bright", "cold")
GOOD_FEELINGS = ("happy", "proud", "glad", "excited", "thankful", "warm inside")
BAD_FEELINGS = ("sad", "upset", "worried", "scared", "grumpy", "lonely")
SAY_STATEMENT = ("said", "said", "said", "shouted", "whispered")
# fmt: on
