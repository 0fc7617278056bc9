"""The small embedded word lists every generator draws from (no download): needle keys and word values, the
common-words pool, and the templates of the encyclopedic haystack (a second domain beside stories: short factual
sentences about invented places, materials and people, with numbers and years in them).

Everything is drawn with a caller's ``random.Random``, so an instance is a function of its seed.
"""

from __future__ import annotations

import random
import uuid

__all__ = ["ADJECTIVES", "NOUNS", "FILLER", "FACT_TEMPLATES", "random_key", "random_value", "fact_sentence"]

ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly", "keen", "lively",
    "mellow", "noisy", "orange", "polite", "quiet", "rapid", "silver", "tidy", "urban", "velvet", "windy", "young",
    "zesty", "bitter", "cosmic", "frozen", "golden", "humble", "ivory", "lucky", "misty", "narrow", "proud", "rusty",
)
NOUNS = (
    "anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "ladder", "magnet", "needle", "oyster", "pepper", "quarry", "rabbit", "saddle", "tunnel", "umbrella", "violin",
    "walrus", "yogurt", "zipper", "button", "cactus", "donkey", "feather", "goblet", "hammer", "lantern", "meadow",
    "pebble", "rocket", "spider", "turtle", "wagon", "basket", "copper", "mirror", "pillow", "walnut", "beacon",
)
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.")
"""RULER's / the passkey test's repeated filler."""

_PLACES = ("Varnholt", "Quillmere", "Ostrava Minor", "Belltarn", "Kestrel Bay", "Dunmoor", "Halvik", "Serrano Flats",
           "Tolberg", "Wrenfield", "Ashcombe", "Marrowdale", "Pendry", "Caldera Vale", "Norwick", "Elsford")
_KINDS = ("river", "mountain range", "coastal town", "research station", "plateau", "lake", "valley", "harbour city",
          "glacier", "forest reserve", "mining district", "island chain")
_MATERIALS = ("granite", "basalt", "copper ore", "limestone", "tin", "salt", "quartz", "clay", "iron", "marble")
_FIELDS = ("botanist", "engineer", "cartographer", "chemist", "historian", "astronomer", "geologist", "architect")
_NAMES = ("Ilse Marrow", "Tomas Keel", "Aria Vence", "Oskar Lind", "Mira Soto", "Hugo Brandt", "Lena Okafor",
          "Pavel Ristic", "Nadia Fenn", "Jonas Eberly", "Selma Kovac", "Rafael Duarte")

FACT_TEMPLATES = (
    "{place} is a {kind} in the northern province, first recorded in {year}.",
    "The {kind} near {place} covers about {num} square kilometres and is known for its {material}.",
    "In {year} the {field} {name} published the first survey of {place}.",
    "Most buildings in {place} are made of {material}, which is quarried {num} kilometres to the east.",
    "The population of {place} was estimated at {num} in the census of {year}.",
    "{name}, a {field} born in {place}, is remembered for a study of {material} deposits.",
    "Trade in {material} made {place} an important stop on the road to the coast after {year}.",
    "The climate of the {kind} is mild, with about {num} millimetres of rain a year.",
    "A railway reached {place} in {year}, and a second line followed {num} years later.",
    "The museum of {place} holds a collection of {material} tools from the early period.",
)


def fact_sentence(rng: random.Random) -> str:
    """One encyclopedic sentence from :data:`FACT_TEMPLATES` with drawn places, names, years and numbers."""
    t = rng.choice(FACT_TEMPLATES)
    return t.format(place=rng.choice(_PLACES), kind=rng.choice(_KINDS), material=rng.choice(_MATERIALS),
                    field=rng.choice(_FIELDS), name=rng.choice(_NAMES), year=rng.randint(1650, 1990),
                    num=rng.randint(3, 900))


def random_key(rng: random.Random, avoid: set[str] = frozenset()) -> str:
    """A needle key such as ``"silver-falcon"`` not in ``avoid``."""
    while True:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in avoid:
            return k


def random_value(kind: str, rng: random.Random, avoid: set[str] = frozenset()) -> str:
    """A needle value: ``number`` (7 digits), ``word`` (one of :data:`NOUNS`) or ``uuid`` (from ``rng``)."""
    while True:
        if kind == "number":
            v = str(rng.randint(1_000_000, 9_999_999))
        elif kind == "word":
            v = rng.choice(NOUNS)
        elif kind == "uuid":
            v = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        else:
            raise ValueError(f"needle value kind must be number, word or uuid, got {kind!r}")
        if v not in avoid:
            return v
