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
from typing import Literal

from data.story_parts import Character, StoryContext, ending_lines, make_child, make_parent, opening_lines, with_article
from data.story_plots import (plot_bake, plot_broken, plot_fear, plot_help, plot_lost, plot_new_friend, plot_race,
                              plot_rain, plot_share, plot_stuck)
from data.story_words import (ACTIVITIES, BAD_FEELINGS, BOY_NAMES, FOODS, GIRL_NAMES,  # noqa: F401  (read by
                              GOOD_FEELINGS, HIGH_OBJECTS, OBJECTS, PET_NAMES, PLACES,  # data.datamodule)
                              SCARY_THINGS, TRAITS, WEATHER)

__all__ = ["GENERATOR_VERSION", "Character", "generate_stories", "iter_stories", "make_story"]

#: Bump whenever the generator's output changes, so cached tokenizers / token shards are rebuilt.
GENERATOR_VERSION = 1

Split = Literal["train", "validation"]

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
    hero = make_child(rng)
    plot = rng.randrange(10)
    # Parents only appear as the second character in plots whose lines suit them (broken toy, fear, baking).
    friend = make_parent(rng) if plot in (2, 4, 5) and rng.random() < 0.35 else make_child(rng, exclude=hero.name)
    place, feature, high, hide = rng.choice(PLACES)
    thing, adjs = rng.choice(OBJECTS)
    if plot == 1:  # stuck up high needs something that can fly or be thrown
        high_thing = rng.choice(HIGH_OBJECTS)
        thing, adjs = next(o for o in OBJECTS if o[0] == high_thing)
    adj = rng.choice(adjs)
    ctx = StoryContext(
        hero,
        friend,
        place=place,
        feature=feature,
        high=high,
        hide=hide,
        thing=thing,
        adj=adj,
        a_thing=with_article(thing),
        a_adj_thing=with_article(f"{adj} {thing}"),
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
    opening = opening_lines(rng, ctx, hero)
    if plot == 0:
        body = plot_lost(rng, ctx)
    elif plot == 1:
        body = plot_stuck(rng, ctx)
    elif plot == 2:
        body = plot_broken(rng, ctx)
    elif plot == 3:
        body = plot_share(rng, ctx)
    elif plot == 4:
        scary, safe = rng.choice(SCARY_THINGS)
        body = plot_fear(rng, ctx, scary, safe)
    elif plot == 5:
        body = plot_bake(rng, ctx, rng.choice(FOODS))
    elif plot == 6:
        body = plot_rain(rng, ctx)
    elif plot == 7:
        body = plot_help(rng, ctx, rng.choice(("bird", "kitten", "bunny", "duck", "puppy", "mouse")))
    elif plot == 8:
        body = plot_race(rng, ctx)
    else:
        body = plot_new_friend(rng, ctx)
    sentences = opening + body + ending_lines(rng, ctx)
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
