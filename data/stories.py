"""Deterministic, offline generator of simple TinyStories-like children's stories.

The generator is the embedded offline data source of :class:`data.TinyStoriesDataModule` (``synthetic=True``). Every
story has a cast (a main character and a friend or parent, each with a name and consistent pronouns that are reused
throughout the story), a place, an object and a small plot (problem -> attempt -> resolution), short dialogue in
quotes, and sometimes a moral. There are many plots, sentence variants and slot fillers, so a small language model has
to learn real structure (name copying, pronoun agreement, plot order) to reach a low loss.

Determinism: the stories depend only on ``(seed, split, index)``; the train and validation splits are drawn from
independent seed streams, so no validation story is produced by the training stream's generator state.

Example:
    >>> from data.stories import generate_stories
    >>> stories = generate_stories(3, seed=0)
    >>> len(stories)
    3
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["GENERATOR_VERSION", "Character", "generate_stories", "iter_stories", "make_story"]

#: Bump whenever the generator's output changes, so cached tokenizers / token shards are rebuilt.
GENERATOR_VERSION = 1

Split = Literal["train", "validation"]

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
PLACES = (
    # (place, a feature of the place, a high spot, a hiding spot)
    ("park", "a big slide", "the tall oak tree", "the bench"),
    ("garden", "many pretty flowers", "the apple tree", "the bushes"),
    ("forest", "tall green trees", "a high branch", "a pile of leaves"),
    ("beach", "soft warm sand", "the top of a big rock", "a sand castle"),
    ("farm", "a red barn", "the roof of the barn", "the hay"),
    ("backyard", "a little swing", "the fence", "the flower pot"),
    ("playground", "a tall climbing frame", "the top of the slide", "the sandbox"),
    ("meadow", "yellow flowers everywhere", "a tall tree", "the long grass"),
    ("lake", "quiet blue water", "a tree by the water", "the reeds"),
    ("village", "small colorful houses", "a rooftop", "a wooden cart"),
    ("zoo", "many funny animals", "a high wall", "a big basket"),
    ("hill", "a great view of the town", "a lonely tree", "a big stone"),
)
OBJECTS = (
    # (object, adjective choices)
    ("ball", ("red", "bouncy", "big", "blue", "shiny")),
    ("kite", ("colorful", "red", "long", "yellow")),
    ("teddy bear", ("soft", "brown", "old", "fluffy")),
    ("toy car", ("fast", "red", "little", "shiny")),
    ("hat", ("green", "funny", "big", "warm")),
    ("book", ("new", "big", "old", "colorful")),
    ("balloon", ("red", "blue", "big", "round")),
    ("doll", ("pretty", "little", "old", "soft")),
    ("shell", ("pink", "shiny", "small", "smooth")),
    ("boat", ("little", "wooden", "blue", "paper")),
    ("drum", ("loud", "red", "little", "new")),
    ("blanket", ("warm", "soft", "blue", "striped")),
    ("necklace", ("shiny", "gold", "pretty", "sparkly")),
    ("crayon", ("purple", "green", "long", "bright")),
    ("puzzle", ("big", "new", "hard", "colorful")),
    ("cup", ("blue", "little", "pretty", "special")),
)
HIGH_OBJECTS = ("kite", "ball", "balloon", "hat")  # things that can get stuck up high
FOODS = ("cookies", "a cake", "pancakes", "a pie", "muffins", "soup", "sandwiches", "a fruit salad")
ACTIVITIES = (
    "play outside", "run and jump", "draw pictures", "sing songs", "dance", "read books", "build towers",
    "look at the clouds", "swim", "pick flowers", "play games", "climb trees",
)
SCARY_THINGS = (
    # (scary thing, what makes it less scary)
    ("the dark", "the night light"),
    ("the loud thunder", "the warm blanket"),
    ("the big waves", "the sand"),
    ("the tall slide", "the ladder"),
    ("the buzzing bees", "the flowers"),
    ("the deep water", "the shallow part"),
)
WEATHER = ("sunny", "warm", "windy", "cloudy", "bright", "cold")
GOOD_FEELINGS = ("happy", "proud", "glad", "excited", "thankful", "warm inside")
BAD_FEELINGS = ("sad", "upset", "worried", "scared", "grumpy", "lonely")
SAY_STATEMENT = ("said", "said", "said", "shouted", "whispered")
# fmt: on

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


def _child(rng: random.Random, exclude: str = "") -> Character:
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


def _parent(rng: random.Random) -> Character:
    """Mom or Dad (animal families have moms and dads too)."""
    female = rng.random() < 0.5
    return Character("Mom" if female else "Dad", "mom" if female else "dad", female)


# --------------------------------------------------------------------------------------------------------------------
# Story building helpers
# --------------------------------------------------------------------------------------------------------------------


class _Ctx(dict):
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


def _a(word: str) -> str:
    """``word`` with the right indefinite article."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def _say(rng: random.Random, ctx: _Ctx, lines: tuple[str, ...], speaker: str = "h", question: bool = False) -> str:
    """A line of dialogue in quotes, with the speaker's name either before or after the quote."""
    line = rng.choice(lines).format(**ctx)
    verb = rng.choice(("asked",) if question else SAY_STATEMENT)
    name = ctx[speaker]
    if rng.random() < 0.5:
        return f'{name} {verb}, "{line}"'
    body = line[:-1] + "," if line.endswith(".") else line
    return f'"{body}" {verb} {name}.'


def _pick(rng: random.Random, ctx: _Ctx, *templates: str) -> str:
    """One of ``templates``, filled from ``ctx``."""
    return rng.choice(templates).format(**ctx)


def _opening(rng: random.Random, ctx: _Ctx, hero: Character) -> list[str]:
    kind = hero.kind
    trait = ctx["trait"]
    s = [
        _pick(
            rng,
            ctx,
            f"Once upon a time, there was {_a(trait)} {kind} named {{h}}.",
            f"Once upon a time, in a small town, there lived {_a(trait)} {kind} named {{h}}.",
            f"There once was {_a(trait)} {kind} called {{h}}.",
            f"{{h}} was {_a(trait)} {kind}.",
            f"Once there was {_a(kind)} named {{h}}. {{Hs}} was very {trait}.",
        )
    ]
    s.append(
        _pick(
            rng,
            ctx,
            "{Hs} loved to {act}.",
            "{Hs} liked to {act} every day.",
            "More than anything, {hs} loved to {act}.",
        )
    )
    return s


def _ending(rng: random.Random, ctx: _Ctx) -> list[str]:
    return [
        _pick(
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


def _moral(rng: random.Random, ctx: _Ctx, morals: tuple[str, ...]) -> list[str]:
    """A moral with probability 0.4."""
    if rng.random() < 0.4:
        return [rng.choice(morals).format(**ctx)]
    return []


# --------------------------------------------------------------------------------------------------------------------
# Plots: each returns the story body as a list of sentences (problem -> attempt -> resolution)
# --------------------------------------------------------------------------------------------------------------------


def _plot_lost(rng: random.Random, ctx: _Ctx) -> list[str]:
    s = [
        _pick(
            rng,
            ctx,
            "One {weather} day, {h} took {hp} {adj} {thing} to the {place}.",
            "One day, {h} went to the {place} with {hp} {adj} {thing}.",
            "{h} had {a_thing} that {hs} loved very much. One day, {hs} took it to the {place}.",
        ),
        _pick(
            rng, ctx, "The {place} had {feature}.", "At the {place}, there was {feature}.", "{h} played near {feature}."
        ),
        _pick(
            rng,
            ctx,
            "When it was time to go home, {h} could not find {hp} {thing}.",
            "After a while, {h} looked around. {Hp} {thing} was gone!",
            "But then {h} saw that {hp} {thing} was missing.",
        ),
        f"{ctx['h']} felt {ctx['bad']}.",
        _say(rng, ctx, ("Where is my {thing}?", "Oh no, I lost my {thing}!", "I can't find my {adj} {thing}!"), "h"),
        _pick(
            rng,
            ctx,
            "{h} looked under the bench and behind the trees, but {hs} could not find it.",
            "{h} looked everywhere, but the {thing} was not there.",
            "{Hs} searched and searched, but {hs} could not see it.",
        ),
        _pick(
            rng, ctx, "Then {f} the {fk} came by.", "Just then, {hp} friend {f} came to help.", "Soon, {f} walked over."
        ),
        _say(rng, ctx, ("Why are you {bad}, {h}?", "What is wrong, {h}?", "Can I help you, {h}?"), "f", question=True),
        _say(rng, ctx, ("I lost my {thing}.", "My {adj} {thing} is gone.", "I can't find my {thing} anywhere."), "h"),
        _say(
            rng,
            ctx,
            ("Don't worry. I will help you look.", "Let's look together!", "I am good at finding things."),
            "f",
        ),
        _pick(
            rng,
            ctx,
            "{f} and {h} looked near {hide}. There it was!",
            "They looked together, and {f} found the {thing} near {hide}.",
            "{f} looked behind {hide} and saw something {adj}. It was the {thing}!",
        ),
        _pick(rng, ctx, "{h} was so {good}.", "{h} jumped up and down with joy.", "{h} hugged {hp} {thing}."),
        _say(
            rng,
            ctx,
            (
                "Thank you, {f}! You are a good friend.",
                "Thank you for helping me, {f}!",
                "You found it, {f}! Thank you!",
            ),
            "h",
        ),
    ]
    return s + _moral(
        rng,
        ctx,
        (
            "{h} learned that friends help each other.",
            "{h} learned to keep {hp} things close.",
            "Helping a friend makes everyone happy.",
        ),
    )


def _plot_stuck(rng: random.Random, ctx: _Ctx) -> list[str]:
    s = [
        _pick(
            rng,
            ctx,
            "One {weather} day, {h} was playing with {hp} {adj} {thing} at the {place}.",
            "{h} took {hp} {thing} to the {place} to play.",
        ),
        _pick(
            rng,
            ctx,
            "Suddenly, a big wind came and the {thing} flew up to {high}.",
            "{h} threw the {thing} too high, and it got stuck in {high}.",
            "Oh no! The {thing} went up and got stuck in {high}.",
        ),
        _say(rng, ctx, ("My {thing}! It is stuck!", "Come down, {thing}!", "How can I get my {thing} back?"), "h"),
        _pick(
            rng,
            ctx,
            "{h} jumped and jumped, but {hs} was too small.",
            "{h} tried to climb up, but it was too high.",
            "{Hs} stood on {hp} toes and reached, but {hs} could not get it.",
        ),
        f"{ctx['h']} felt {ctx['bad']}.",
        _pick(
            rng,
            ctx,
            "Then {f} came to see what was wrong.",
            "Just then, {f} the {fk} walked by.",
            "{f} saw {h} and came to help.",
        ),
        _say(rng, ctx, ("I have an idea!", "Let me help you, {h}.", "Don't be {bad}. We can get it together."), "f"),
        _pick(
            rng,
            ctx,
            "{f} found a long stick and pushed the {thing} down.",
            "{f} held {h} up high, and {h} grabbed the {thing}.",
            "{f} climbed up carefully and got the {thing}.",
            "{f} shook the branch gently, and the {thing} fell down.",
        ),
        _pick(rng, ctx, "{h} caught the {thing} and laughed.", "The {thing} was back!", "{h} had {hp} {thing} again."),
        _say(rng, ctx, ("Thank you, {f}!", "You are so smart, {f}!", "We did it!"), "h"),
    ]
    return s + _moral(
        rng, ctx, ("When we work together, we can do hard things.", "{h} learned that it is good to ask for help.")
    )


def _plot_broken(rng: random.Random, ctx: _Ctx) -> list[str]:
    s = [
        _pick(
            rng, ctx, "{h} had {a_adj_thing}. {Hs} played with it every day.", "{h} loved {hp} {adj} {thing} very much."
        ),
        _pick(
            rng,
            ctx,
            "One day, {h} was running with the {thing} and fell down.",
            "One day, {h} dropped the {thing} on the floor.",
            "One day, {h} played too rough with the {thing}.",
        ),
        _pick(rng, ctx, "The {thing} broke!", "Crack! The {thing} was broken.", "The {thing} had a big rip in it."),
        _pick(rng, ctx, "{h} started to cry.", "{h} was very {bad}.", "Tears came to {hp} eyes."),
        _say(rng, ctx, ("My {thing} is broken!", "Oh no, what did I do?", "Now I can't play with my {thing}."), "h"),
        _pick(rng, ctx, "{f} heard {h} crying and came over.", "{f} saw the broken {thing}."),
        _say(
            rng,
            ctx,
            ("Don't cry, {h}. We can fix it.", "Let me see. I think we can fix it.", "It's okay, {h}. I will help."),
            "f",
        ),
        _pick(
            rng,
            ctx,
            "{f} got some glue and fixed the {thing}.",
            "{f} and {h} used tape to fix the {thing}.",
            "{f} sewed the {thing} with a needle and thread.",
        ),
        _pick(
            rng,
            ctx,
            "Soon the {thing} looked almost new.",
            "The {thing} was fixed!",
            "Now the {thing} was as good as new.",
        ),
        _say(rng, ctx, ("Thank you! I will be more careful.", "You fixed it! Thank you, {f}!"), "h"),
    ]
    return s + _moral(
        rng, ctx, ("{h} learned to be careful with {hp} things.", "Broken things can be fixed with love and help.")
    )


def _plot_share(rng: random.Random, ctx: _Ctx) -> list[str]:
    s = [
        _pick(rng, ctx, "{h} got {a_adj_thing} as a gift.", "{h} had a new {thing}. It was {adj} and beautiful."),
        _pick(rng, ctx, "{Hs} took it to the {place}.", "{Hs} played with it at the {place} all morning."),
        _pick(rng, ctx, "{f} saw the {thing} and wanted to play too.", "Then {f} came and looked at the {thing}."),
        _say(
            rng, ctx, ("Can I play with your {thing}, {h}?", "Will you share your {thing} with me?"), "f", question=True
        ),
        _say(rng, ctx, ("No! It is my {thing}.", "No, I want to play with it by myself.", "Go away, it is mine!"), "h"),
        _pick(
            rng,
            ctx,
            "{f} felt {bad} and walked away.",
            "{f} was {bad}. {Fs} sat down alone.",
            "{f} looked at the ground and did not say anything.",
        ),
        _pick(
            rng,
            ctx,
            "{h} played alone, but it was not fun anymore.",
            "Soon {h} felt bored. Playing alone was not fun.",
            "{h} looked at {f}. {Hs} did not feel happy.",
        ),
        _pick(rng, ctx, "Then {h} had an idea.", "{h} thought for a moment.", "{h} walked over to {f}."),
        _say(
            rng,
            ctx,
            (
                "I am sorry, {f}. Do you want to play with me?",
                "Here, {f}. Let's play with the {thing} together.",
                "I'm sorry. We can share.",
            ),
            "h",
        ),
        _pick(rng, ctx, "{f} smiled a big smile.", "{f} said yes and hugged {h}.", "{f} was so {good}."),
        _pick(
            rng,
            ctx,
            "They played with the {thing} together and had lots of fun.",
            "Playing together was much more fun.",
        ),
    ]
    return s + _moral(
        rng,
        ctx,
        (
            "{h} learned that sharing is caring.",
            "Sharing makes everyone happy.",
            "It is more fun to play with a friend.",
        ),
    )


def _plot_fear(rng: random.Random, ctx: _Ctx, scary: str, safe: str) -> list[str]:
    s = [
        _pick(rng, ctx, f"But {{h}} was afraid of {scary}.", f"There was one thing {{h}} did not like: {scary}."),
        _pick(rng, ctx, f"Every time {{hs}} saw {scary}, {{hs}} wanted to hide.", "It made {ho} feel small and {bad}."),
        _pick(
            rng, ctx, "One day, {h} went to the {place} with {f}.", "One {weather} day, {f} took {h} to the {place}."
        ),
        _pick(rng, ctx, f"There was {scary} again.", f"Soon, {{h}} saw {scary}."),
        _say(rng, ctx, ("I'm scared!", "I don't like it. I want to go home.", "Please help me, I am afraid."), "h"),
        _say(
            rng,
            ctx,
            (
                "It's okay, {h}. I am here with you.",
                "Hold my hand, {h}. You are safe.",
                "Don't be afraid. Let's be brave together.",
            ),
            "f",
        ),
        _pick(rng, ctx, f"{{f}} showed {{h}} {safe}.", "{f} held {hp} hand tight.", "{f} told {ho} a funny story."),
        _pick(rng, ctx, "{h} took a deep breath.", "{h} counted to three.", "{h} felt a little better."),
        _pick(
            rng,
            ctx,
            f"Then {{hs}} looked at {scary} and was not scared anymore.",
            "{Hs} was brave!",
            "Slowly, {hs} smiled.",
        ),
        _say(
            rng,
            ctx,
            ("I did it! I am brave!", "It is not so scary after all.", "Thank you, {f}. I feel brave now."),
            "h",
        ),
    ]
    return s + _moral(
        rng,
        ctx,
        ("{h} learned that being brave is easier with a friend.", "Everyone feels scared sometimes, and that is okay."),
    )


def _plot_bake(rng: random.Random, ctx: _Ctx, food: str) -> list[str]:
    s = [
        _pick(
            rng,
            ctx,
            f"One day, {{h}} wanted to make {food} for {{f}}.",
            f"It was {{f}}'s birthday, and {{h}} wanted to make {food}.",
        ),
        _pick(rng, ctx, "{Hs} went to the kitchen and got a big bowl.", "{Hs} found flour, eggs and sugar."),
        _pick(
            rng,
            ctx,
            "But {h} spilled the flour on the floor. What a mess!",
            "{h} mixed too fast, and the batter went everywhere!",
            "The eggs fell and broke on the floor.",
        ),
        _pick(rng, ctx, "{h} felt {bad}.", "{h} wanted to give up."),
        _say(rng, ctx, ("Oh no! Now I can't make it.", "Everything is ruined!", "I made a big mess."), "h"),
        _pick(rng, ctx, "{hmom} came into the kitchen.", "Just then, {hmom} walked in."),
        _say(
            rng,
            ctx,
            ("It's okay. Let's clean up and try again together.", "Don't worry. Everybody makes mistakes."),
            "hmom",
        ),
        _pick(rng, ctx, "They cleaned up and started again, slowly this time.", "They tried again, step by step."),
        _pick(rng, ctx, f"Soon the {food} smelled wonderful.", f"This time, the {food} came out just right."),
        _pick(rng, ctx, f"{{f}} tasted the {food} and smiled.", f"{{h}} gave the {food} to {{f}}."),
        _say(rng, ctx, ("This is the best surprise ever! Thank you, {h}!", "Yummy! You are so kind, {h}."), "f"),
    ]
    return s + _moral(
        rng, ctx, ("{h} learned that it is okay to make mistakes.", "If at first you don't succeed, try again.")
    )


def _plot_rain(rng: random.Random, ctx: _Ctx) -> list[str]:
    s = [
        _pick(
            rng,
            ctx,
            "One morning, {h} wanted to go to the {place} with {f}.",
            "{h} and {f} planned to play at the {place}.",
        ),
        _pick(
            rng,
            ctx,
            "But then it started to rain.",
            "But dark clouds came, and rain began to fall.",
            "But the sky turned gray and it rained and rained.",
        ),
        _say(rng, ctx, ("Now we can't go outside!", "I don't like the rain.", "Why does it have to rain today?"), "h"),
        _pick(rng, ctx, "{h} sat by the window and felt {bad}.", "{h} was very {bad}."),
        _say(
            rng,
            ctx,
            (
                "Let's play inside! We can build a fort.",
                "We can have fun inside, {h}. Let's draw!",
                "Let's play a game with your {thing}.",
            ),
            "f",
        ),
        _pick(
            rng,
            ctx,
            "They built a big fort with pillows and blankets.",
            "They drew pictures of the {place} with bright colors.",
            "They played with the {adj} {thing} on the floor.",
        ),
        _pick(rng, ctx, "They laughed and had so much fun.", "It was even more fun than the {place}."),
        _pick(rng, ctx, "Later, the rain stopped and a rainbow came out.", "When the rain stopped, the sun came back."),
        _say(rng, ctx, ("Look, a rainbow!", "The sun is back! Let's go outside!"), "h"),
    ]
    return s + _moral(
        rng, ctx, ("{h} learned that you can have fun on any day.", "A rainy day can be a happy day too.")
    )


def _plot_help(rng: random.Random, ctx: _Ctx, animal: str) -> list[str]:
    s = [
        _pick(
            rng, ctx, "One day, {h} was walking in the {place}.", "One {weather} day, {h} and {f} went to the {place}."
        ),
        _pick(
            rng,
            ctx,
            f"{{Hs}} heard a small sound. It was a little {animal}.",
            f"Near {{hide}}, {{hs}} saw a little {animal}.",
        ),
        _pick(
            rng,
            ctx,
            f"The {animal} had a hurt leg and could not move.",
            f"The {animal} was cold and hungry.",
            f"The {animal} was lost and could not find its mom.",
        ),
        _say(rng, ctx, (f"Poor little {animal}! I will help you.", "Don't worry, little one. You are safe now."), "h"),
        _pick(
            rng,
            ctx,
            f"{{h}} picked up the {animal} gently and took it home.",
            f"{{h}} wrapped the {animal} in {{hp}} {{thing}} to keep it warm.",
            f"{{h}} and {{f}} gave the {animal} some water and food.",
        ),
        _pick(rng, ctx, f"Every day, {{h}} took care of the {animal}.", f"{{h}} sang softly to the {animal}."),
        _pick(rng, ctx, f"Soon, the {animal} was strong again.", f"After a few days, the {animal} felt much better."),
        _pick(
            rng,
            ctx,
            f"One morning, the {animal} went back to its family.",
            f"The {animal} said goodbye and ran back home.",
            f"Then the {animal} found its mom.",
        ),
        _pick(rng, ctx, "{h} felt a little sad, but also very {good}.", "{h} waved goodbye and smiled."),
    ]
    return s + _moral(
        rng, ctx, ("{h} learned that being kind to animals is important.", "It feels good to help others.")
    )


def _plot_race(rng: random.Random, ctx: _Ctx) -> list[str]:
    s = [
        _pick(rng, ctx, "One day, {h} and {f} had a race at the {place}.", '{f} said to {h}, "Let\'s race to {high}!"'),
        _pick(rng, ctx, "Ready, set, go! They ran as fast as they could.", "They counted to three and started to run."),
        _pick(
            rng,
            ctx,
            "{h} was winning, but then {f} tripped and fell.",
            "Halfway there, {f} fell down and hurt {fp} knee.",
        ),
        _say(rng, ctx, ("Ouch! My knee hurts!", "Help! I fell down!"), "f"),
        _pick(
            rng, ctx, "{h} could win the race, but {hs} stopped.", "{h} looked at the finish, then looked back at {f}."
        ),
        _pick(rng, ctx, "{Hs} ran back to help {fo}.", "{Hs} went back and helped {f} stand up."),
        _say(
            rng, ctx, ("Are you okay, {f}? Let's finish together.", "Winning is not important. You are my friend."), "h"
        ),
        _pick(
            rng, ctx, "They walked to the finish together, holding hands.", "Together, they crossed the finish line."
        ),
        _pick(rng, ctx, "Everyone clapped for them.", "{f} smiled and said thank you."),
    ]
    return s + _moral(
        rng,
        ctx,
        ("{h} learned that friends are more important than winning.", "Being kind is better than being first."),
    )


def _plot_new_friend(rng: random.Random, ctx: _Ctx) -> list[str]:
    s = [
        _pick(
            rng,
            ctx,
            "{h} lived near the {place}, but {hs} had no friends there.",
            "{h} was new in town and felt {bad}.",
        ),
        _pick(
            rng, ctx, "Every day, {hs} played alone with {hp} {thing}.", "{Hs} wished {hs} had someone to play with."
        ),
        _pick(
            rng,
            ctx,
            "One day, {hs} saw {f} the {fk} sitting alone near {hide}.",
            "One day, a {fk} named {f} came to the {place}.",
        ),
        _pick(rng, ctx, "{f} looked shy.", "{f} looked {bad} too."),
        _pick(rng, ctx, "{h} wanted to say hello, but {hs} was nervous.", "{h} took a deep breath and walked over."),
        _say(
            rng, ctx, ("Hi, I am {h}. Do you want to play with me?", "Hello! Do you like to {act}?"), "h", question=True
        ),
        _say(rng, ctx, ("Yes, I would love to!", "Yes! My name is {f}.", "Really? Yes, please!"), "f"),
        _pick(rng, ctx, "They played with the {adj} {thing} all afternoon.", "They loved to {act} together."),
        _pick(rng, ctx, "Soon, they were the best of friends.", "{h} was not {bad} anymore."),
    ]
    return s + _moral(
        rng,
        ctx,
        ("Sometimes a new friend is just one hello away.", "{h} learned that it is good to be brave and say hello."),
    )


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def make_story(rng: random.Random) -> str:
    """One story drawn with ``rng``.

    Args:
        rng: the random source (the story is a deterministic function of its state).

    Returns:
        The story: sentences joined by spaces, paragraphs by single newlines (like TinyStories), no trailing newline.
    """
    hero = _child(rng)
    plot = rng.randrange(10)
    # Parents only appear as the second character in plots whose lines suit them (broken toy, fear, baking).
    friend = _parent(rng) if plot in (2, 4, 5) and rng.random() < 0.35 else _child(rng, exclude=hero.name)
    place, feature, high, hide = rng.choice(PLACES)
    thing, adjs = rng.choice(OBJECTS)
    if plot == 1:  # stuck up high needs something that can fly or be thrown
        high_thing = rng.choice(HIGH_OBJECTS)
        thing, adjs = next(o for o in OBJECTS if o[0] == high_thing)
    adj = rng.choice(adjs)
    ctx = _Ctx(
        hero,
        friend,
        place=place,
        feature=feature,
        high=high,
        hide=hide,
        thing=thing,
        adj=adj,
        a_thing=_a(thing),
        a_adj_thing=_a(f"{adj} {thing}"),
        trait=rng.choice(TRAITS),
        act=rng.choice(ACTIVITIES),
        weather=rng.choice(WEATHER),
        good=rng.choice(GOOD_FEELINGS),
        bad=rng.choice(BAD_FEELINGS),
        # the grown-up who helps in the baking plot (never the same person as a parent ``friend``)
        hmom=rng.choice(
            ("Dad", f"{hero.pos.capitalize()} dad")
            if friend.name == "Mom"
            else ("Mom", f"{hero.pos.capitalize()} mom")
            if friend.name == "Dad"
            else ("Mom", "Dad", f"{hero.pos.capitalize()} mom", f"{hero.pos.capitalize()} dad")
        ),
    )
    opening = _opening(rng, ctx, hero)
    if plot == 0:
        body = _plot_lost(rng, ctx)
    elif plot == 1:
        body = _plot_stuck(rng, ctx)
    elif plot == 2:
        body = _plot_broken(rng, ctx)
    elif plot == 3:
        body = _plot_share(rng, ctx)
    elif plot == 4:
        scary, safe = rng.choice(SCARY_THINGS)
        body = _plot_fear(rng, ctx, scary, safe)
    elif plot == 5:
        body = _plot_bake(rng, ctx, rng.choice(FOODS))
    elif plot == 6:
        body = _plot_rain(rng, ctx)
    elif plot == 7:
        body = _plot_help(rng, ctx, rng.choice(("bird", "kitten", "bunny", "duck", "puppy", "mouse")))
    elif plot == 8:
        body = _plot_race(rng, ctx)
    else:
        body = _plot_new_friend(rng, ctx)
    sentences = opening + body + _ending(rng, ctx)
    # Paragraphs: opening | first half of the body | rest, like TinyStories' "\n"-separated paragraphs.
    cut = len(opening) + max(2, len(body) // 2)
    paragraphs = [opening, sentences[len(opening) : cut], sentences[cut:]]
    return "\n".join(" ".join(p) for p in paragraphs if p)


def _stream_rng(seed: int, split: Split) -> random.Random:
    """Independent, platform-stable random stream per (seed, split)."""
    return random.Random(f"kvsplice-stories/v{GENERATOR_VERSION}/{split}/{seed}")


def iter_stories(n: int, seed: int = 1337, split: Split = "train") -> Iterator[str]:
    """Yield ``n`` stories for ``split`` deterministically from ``seed``.

    Args:
        n: number of stories.
        seed: base seed; the same ``(seed, split)`` always yields the same stories.
        split: ``"train"`` or ``"validation"``; the two splits use independent random streams.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = _stream_rng(seed, split)
    for _ in range(n):
        yield make_story(rng)


def generate_stories(n: int, seed: int = 1337, split: Split = "train") -> list[str]:
    """``n`` stories for ``split`` as a list (see :func:`iter_stories`)."""
    return list(iter_stories(n, seed, split))
