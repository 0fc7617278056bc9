"""Characters (names, pronouns) and sentence helpers of the offline story generator (:mod:`data.stories`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from data.story_words import ANIMALS, BOY_NAMES, GIRL_NAMES, PET_NAMES, SAY_STATEMENT


# --------------------------------------------------------------------------------------------------------------------
# Characters
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Character:
    """A story character with consistent pronouns.

    Attributes:
        name: the character's name (or a role such as "Mom", used as a name).
        kind: what the character is ("girl", "boy", "cat", ...).
        female: selects she/her or he/him/his.
    """

    name: str
    kind: str
    female: bool

    @property
    def sub(self) -> str:
        """Subject pronoun (she/he)."""
        return "she" if self.female else "he"

    @property
    def obj(self) -> str:
        """Object pronoun (her/him)."""
        return "her" if self.female else "him"

    @property
    def pos(self) -> str:
        """Possessive determiner (her/his)."""
        return "her" if self.female else "his"

    @property
    def refl(self) -> str:
        """Reflexive pronoun (herself/himself)."""
        return "herself" if self.female else "himself"


def make_child(rng: random.Random, exclude: str = "") -> Character:
    """A human child or a named animal, never named ``exclude``."""
    while True:
        if rng.random() < 0.6:
            female = rng.random() < 0.5
            name = rng.choice(GIRL_NAMES if female else BOY_NAMES)
            kind = "girl" if female else "boy"
        else:
            female = rng.random() < 0.5
            name = rng.choice(PET_NAMES)
            kind = rng.choice(ANIMALS)
        if name != exclude:
            return Character(name, kind, female)


def make_parent(rng: random.Random) -> Character:
    """Mom or Dad (animal families have moms and dads too)."""
    female = rng.random() < 0.5
    return Character("Mom" if female else "Dad", "mom" if female else "dad", female)


# --------------------------------------------------------------------------------------------------------------------
# Story building helpers
# --------------------------------------------------------------------------------------------------------------------


class StoryContext(dict):
    """Template context: ``{h}`` is the hero's name, ``{hs}``/``{Hs}`` the subject pronoun, ``{ho}`` object,
    ``{hp}``/``{Hp}`` possessive, ``{hr}`` reflexive; ``{f*}`` the same for the friend."""

    def __init__(self, hero: Character, friend: Character, **slots: str) -> None:
        super().__init__(**slots)
        for key, c in (("h", hero), ("f", friend)):
            self[key] = c.name
            self[key + "k"] = c.kind
            self[key + "s"] = c.sub
            self[key.upper() + "s"] = c.sub.capitalize()
            self[key + "o"] = c.obj
            self[key + "p"] = c.pos
            self[key.upper() + "p"] = c.pos.capitalize()
            self[key + "r"] = c.refl


def with_article(word: str) -> str:
    """``word`` with the right indefinite article."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def say_line(rng: random.Random, ctx: StoryContext, lines: tuple[str, ...], speaker: str = "h", question: bool = False) -> str:
    """A line of dialogue in quotes, with the speaker's name either before or after the quote."""
    line = rng.choice(lines).format(**ctx)
    verb = rng.choice(("asked",) if question else SAY_STATEMENT)
    name = ctx[speaker]
    if rng.random() < 0.5:
        return f'{name} {verb}, "{line}"'
    body = line[:-1] + "," if line.endswith(".") else line
    return f'"{body}" {verb} {name}.'


def pick_line(rng: random.Random, ctx: StoryContext, *templates: str) -> str:
    """One of ``templates``, filled from ``ctx``."""
    return rng.choice(templates).format(**ctx)


def opening_lines(rng: random.Random, ctx: StoryContext, hero: Character) -> list[str]:
    kind = hero.kind
    trait = ctx["trait"]
    s = [
        pick_line(
            rng,
            ctx,
            f"Once upon a time, there was {with_article(trait)} {kind} named {{h}}.",
            f"Once upon a time, in a small town, there lived {with_article(trait)} {kind} named {{h}}.",
            f"There once was {with_article(trait)} {kind} called {{h}}.",
            f"{{h}} was {with_article(trait)} {kind}.",
            f"Once there was {with_article(kind)} named {{h}}. {{Hs}} was very {trait}.",
        )
    ]
    s.append(
        pick_line(
            rng,
            ctx,
            "{Hs} loved to {act}.",
            "{Hs} liked to {act} every day.",
            "More than anything, {hs} loved to {act}.",
        )
    )
    return s


def ending_lines(rng: random.Random, ctx: StoryContext) -> list[str]:
    return [
        pick_line(
            rng,
            ctx,
            "From that day on, {h} and {f} were the best of friends.",
            "They played together until the sun went down.",
            "{h} smiled. It was the best day ever.",
            "That night, {h} went to bed with a big smile on {hp} face.",
            "{h} and {f} laughed and went home together.",
            "And they all lived happily ever after.",
            "{h} felt {good}, and {f} felt {good} too.",
        )
    ]


def moral_lines(rng: random.Random, ctx: StoryContext, morals: tuple[str, ...]) -> list[str]:
    """A moral with probability 0.4."""
    if rng.random() < 0.4:
        return [rng.choice(morals).format(**ctx)]
    return []
