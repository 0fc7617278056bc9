"""The plots of the offline story generator (:mod:`data.stories`): each returns a story body as a list of sentences
(problem -> attempt -> resolution)."""

from __future__ import annotations

import random
from typing import NamedTuple, Sequence, Union

from data.story_parts import StoryContext, moral_lines, pick_line, say_line


class Say(NamedTuple):
    """A plot step that is a line of dialogue: one of ``lines``, said (or, with ``question``, asked) by ``speaker``
    (a context key: ``h`` the hero, ``f`` the friend, ``hmom``)."""

    lines: tuple[str, ...]
    speaker: str = "h"
    question: bool = False


Step = Union[str, tuple[str, ...], Say]
"""A plot step: a sentence template, a tuple of templates to pick one of, or a :class:`Say`."""


def tell(rng: random.Random, ctx: StoryContext, steps: Sequence[Step], morals: tuple[str, ...]) -> list[str]:
    """A plot's sentences, step by step in order (each draw from ``rng`` in the order of the steps), then perhaps one
    of ``morals``: a template is filled from ``ctx``, a tuple is :func:`pick_line`, a :class:`Say` :func:`say_line`."""
    out = []
    for step in steps:
        if isinstance(step, Say):
            out.append(say_line(rng, ctx, step.lines, step.speaker, step.question))
        elif isinstance(step, tuple):
            out.append(pick_line(rng, ctx, *step))
        else:
            out.append(step.format(**ctx))
    return out + moral_lines(rng, ctx, morals)


# --------------------------------------------------------------------------------------------------------------------
# Plots: each returns the story body as a list of sentences (problem -> attempt -> resolution)
# --------------------------------------------------------------------------------------------------------------------


def plot_lost(rng: random.Random, ctx: StoryContext) -> list[str]:
    return tell(rng, ctx, [
        (
            "One {weather} day, {h} took {hp} {adj} {thing} to the {place}.",
            "One day, {h} went to the {place} with {hp} {adj} {thing}.",
            "{h} had {a_thing} that {hs} loved very much. One day, {hs} took it to the {place}.",
        ),
        ("The {place} had {feature}.", "At the {place}, there was {feature}.", "{h} played near {feature}."),
        (
            "When it was time to go home, {h} could not find {hp} {thing}.",
            "After a while, {h} looked around. {Hp} {thing} was gone!",
            "But then {h} saw that {hp} {thing} was missing.",
        ),
        "{h} felt {bad}.",
        Say(("Where is my {thing}?", "Oh no, I lost my {thing}!", "I can't find my {adj} {thing}!"), "h"),
        (
            "{h} looked under the bench and behind the trees, but {hs} could not find it.",
            "{h} looked everywhere, but the {thing} was not there.",
            "{Hs} searched and searched, but {hs} could not see it.",
        ),
        ("Then {f} the {fk} came by.", "Just then, {hp} friend {f} came to help.", "Soon, {f} walked over."),
        Say(("Why are you {bad}, {h}?", "What is wrong, {h}?", "Can I help you, {h}?"), "f", question=True),
        Say(("I lost my {thing}.", "My {adj} {thing} is gone.", "I can't find my {thing} anywhere."), "h"),
        Say(("Don't worry. I will help you look.", "Let's look together!", "I am good at finding things."), "f"),
        (
            "{f} and {h} looked near {hide}. There it was!",
            "They looked together, and {f} found the {thing} near {hide}.",
            "{f} looked behind {hide} and saw something {adj}. It was the {thing}!",
        ),
        ("{h} was so {good}.", "{h} jumped up and down with joy.", "{h} hugged {hp} {thing}."),
        Say(
            (
                "Thank you, {f}! You are a good friend.",
                "Thank you for helping me, {f}!",
                "You found it, {f}! Thank you!",
            ),
            "h",
        ),
    ], (
        "{h} learned that friends help each other.",
        "{h} learned to keep {hp} things close.",
        "Helping a friend makes everyone happy.",
    ))


def plot_stuck(rng: random.Random, ctx: StoryContext) -> list[str]:
    return tell(rng, ctx, [
        (
            "One {weather} day, {h} was playing with {hp} {adj} {thing} at the {place}.",
            "{h} took {hp} {thing} to the {place} to play.",
        ),
        (
            "Suddenly, a big wind came and the {thing} flew up to {high}.",
            "{h} threw the {thing} too high, and it got stuck in {high}.",
            "Oh no! The {thing} went up and got stuck in {high}.",
        ),
        Say(("My {thing}! It is stuck!", "Come down, {thing}!", "How can I get my {thing} back?"), "h"),
        (
            "{h} jumped and jumped, but {hs} was too small.",
            "{h} tried to climb up, but it was too high.",
            "{Hs} stood on {hp} toes and reached, but {hs} could not get it.",
        ),
        "{h} felt {bad}.",
        ("Then {f} came to see what was wrong.", "Just then, {f} the {fk} walked by.", "{f} saw {h} and came to help."),
        Say(("I have an idea!", "Let me help you, {h}.", "Don't be {bad}. We can get it together."), "f"),
        (
            "{f} found a long stick and pushed the {thing} down.",
            "{f} held {h} up high, and {h} grabbed the {thing}.",
            "{f} climbed up carefully and got the {thing}.",
            "{f} shook the branch gently, and the {thing} fell down.",
        ),
        ("{h} caught the {thing} and laughed.", "The {thing} was back!", "{h} had {hp} {thing} again."),
        Say(("Thank you, {f}!", "You are so smart, {f}!", "We did it!"), "h"),
    ], ("When we work together, we can do hard things.", "{h} learned that it is good to ask for help."))


def plot_broken(rng: random.Random, ctx: StoryContext) -> list[str]:
    return tell(rng, ctx, [
        ("{h} had {a_adj_thing}. {Hs} played with it every day.", "{h} loved {hp} {adj} {thing} very much."),
        (
            "One day, {h} was running with the {thing} and fell down.",
            "One day, {h} dropped the {thing} on the floor.",
            "One day, {h} played too rough with the {thing}.",
        ),
        ("The {thing} broke!", "Crack! The {thing} was broken.", "The {thing} had a big rip in it."),
        ("{h} started to cry.", "{h} was very {bad}.", "Tears came to {hp} eyes."),
        Say(("My {thing} is broken!", "Oh no, what did I do?", "Now I can't play with my {thing}."), "h"),
        ("{f} heard {h} crying and came over.", "{f} saw the broken {thing}."),
        Say(
            (
                "Don't cry, {h}. We can fix it.",
                "Let me see. I think we can fix it.",
                "It's okay, {h}. I will help.",
            ),
            "f",
        ),
        (
            "{f} got some glue and fixed the {thing}.",
            "{f} and {h} used tape to fix the {thing}.",
            "{f} sewed the {thing} with a needle and thread.",
        ),
        ("Soon the {thing} looked almost new.", "The {thing} was fixed!", "Now the {thing} was as good as new."),
        Say(("Thank you! I will be more careful.", "You fixed it! Thank you, {f}!"), "h"),
    ], ("{h} learned to be careful with {hp} things.", "Broken things can be fixed with love and help."))


def plot_share(rng: random.Random, ctx: StoryContext) -> list[str]:
    return tell(rng, ctx, [
        ("{h} got {a_adj_thing} as a gift.", "{h} had a new {thing}. It was {adj} and beautiful."),
        ("{Hs} took it to the {place}.", "{Hs} played with it at the {place} all morning."),
        ("{f} saw the {thing} and wanted to play too.", "Then {f} came and looked at the {thing}."),
        Say(("Can I play with your {thing}, {h}?", "Will you share your {thing} with me?"), "f", question=True),
        Say(("No! It is my {thing}.", "No, I want to play with it by myself.", "Go away, it is mine!"), "h"),
        (
            "{f} felt {bad} and walked away.",
            "{f} was {bad}. {Fs} sat down alone.",
            "{f} looked at the ground and did not say anything.",
        ),
        (
            "{h} played alone, but it was not fun anymore.",
            "Soon {h} felt bored. Playing alone was not fun.",
            "{h} looked at {f}. {Hs} did not feel happy.",
        ),
        ("Then {h} had an idea.", "{h} thought for a moment.", "{h} walked over to {f}."),
        Say(
            (
                "I am sorry, {f}. Do you want to play with me?",
                "Here, {f}. Let's play with the {thing} together.",
                "I'm sorry. We can share.",
            ),
            "h",
        ),
        ("{f} smiled a big smile.", "{f} said yes and hugged {h}.", "{f} was so {good}."),
        ("They played with the {thing} together and had lots of fun.", "Playing together was much more fun."),
    ], (
        "{h} learned that sharing is caring.",
        "Sharing makes everyone happy.",
        "It is more fun to play with a friend.",
    ))


def plot_fear(rng: random.Random, ctx: StoryContext, scary: str, safe: str) -> list[str]:
    return tell(rng, ctx, [
        (f"But {{h}} was afraid of {scary}.", f"There was one thing {{h}} did not like: {scary}."),
        (f"Every time {{hs}} saw {scary}, {{hs}} wanted to hide.", "It made {ho} feel small and {bad}."),
        ("One day, {h} went to the {place} with {f}.", "One {weather} day, {f} took {h} to the {place}."),
        (f"There was {scary} again.", f"Soon, {{h}} saw {scary}."),
        Say(("I'm scared!", "I don't like it. I want to go home.", "Please help me, I am afraid."), "h"),
        Say(
            (
                "It's okay, {h}. I am here with you.",
                "Hold my hand, {h}. You are safe.",
                "Don't be afraid. Let's be brave together.",
            ),
            "f",
        ),
        (f"{{f}} showed {{h}} {safe}.", "{f} held {hp} hand tight.", "{f} told {ho} a funny story."),
        ("{h} took a deep breath.", "{h} counted to three.", "{h} felt a little better."),
        (f"Then {{hs}} looked at {scary} and was not scared anymore.", "{Hs} was brave!", "Slowly, {hs} smiled."),
        Say(("I did it! I am brave!", "It is not so scary after all.", "Thank you, {f}. I feel brave now."), "h"),
    ], ("{h} learned that being brave is easier with a friend.", "Everyone feels scared sometimes, and that is okay."))


def plot_bake(rng: random.Random, ctx: StoryContext, food: str) -> list[str]:
    return tell(rng, ctx, [
        (
            f"One day, {{h}} wanted to make {food} for {{f}}.",
            f"It was {{f}}'s birthday, and {{h}} wanted to make {food}.",
        ),
        ("{Hs} went to the kitchen and got a big bowl.", "{Hs} found flour, eggs and sugar."),
        (
            "But {h} spilled the flour on the floor. What a mess!",
            "{h} mixed too fast, and the batter went everywhere!",
            "The eggs fell and broke on the floor.",
        ),
        ("{h} felt {bad}.", "{h} wanted to give up."),
        Say(("Oh no! Now I can't make it.", "Everything is ruined!", "I made a big mess."), "h"),
        ("{hmom} came into the kitchen.", "Just then, {hmom} walked in."),
        Say(("It's okay. Let's clean up and try again together.", "Don't worry. Everybody makes mistakes."), "hmom"),
        ("They cleaned up and started again, slowly this time.", "They tried again, step by step."),
        (f"Soon the {food} smelled wonderful.", f"This time, the {food} came out just right."),
        (f"{{f}} tasted the {food} and smiled.", f"{{h}} gave the {food} to {{f}}."),
        Say(("This is the best surprise ever! Thank you, {h}!", "Yummy! You are so kind, {h}."), "f"),
    ], ("{h} learned that it is okay to make mistakes.", "If at first you don't succeed, try again."))


def plot_rain(rng: random.Random, ctx: StoryContext) -> list[str]:
    return tell(rng, ctx, [
        ("One morning, {h} wanted to go to the {place} with {f}.", "{h} and {f} planned to play at the {place}."),
        (
            "But then it started to rain.",
            "But dark clouds came, and rain began to fall.",
            "But the sky turned gray and it rained and rained.",
        ),
        Say(("Now we can't go outside!", "I don't like the rain.", "Why does it have to rain today?"), "h"),
        ("{h} sat by the window and felt {bad}.", "{h} was very {bad}."),
        Say(
            (
                "Let's play inside! We can build a fort.",
                "We can have fun inside, {h}. Let's draw!",
                "Let's play a game with your {thing}.",
            ),
            "f",
        ),
        (
            "They built a big fort with pillows and blankets.",
            "They drew pictures of the {place} with bright colors.",
            "They played with the {adj} {thing} on the floor.",
        ),
        ("They laughed and had so much fun.", "It was even more fun than the {place}."),
        ("Later, the rain stopped and a rainbow came out.", "When the rain stopped, the sun came back."),
        Say(("Look, a rainbow!", "The sun is back! Let's go outside!"), "h"),
    ], ("{h} learned that you can have fun on any day.", "A rainy day can be a happy day too."))


def plot_help(rng: random.Random, ctx: StoryContext, animal: str) -> list[str]:
    return tell(rng, ctx, [
        ("One day, {h} was walking in the {place}.", "One {weather} day, {h} and {f} went to the {place}."),
        (f"{{Hs}} heard a small sound. It was a little {animal}.", f"Near {{hide}}, {{hs}} saw a little {animal}."),
        (
            f"The {animal} had a hurt leg and could not move.",
            f"The {animal} was cold and hungry.",
            f"The {animal} was lost and could not find its mom.",
        ),
        Say((f"Poor little {animal}! I will help you.", "Don't worry, little one. You are safe now."), "h"),
        (
            f"{{h}} picked up the {animal} gently and took it home.",
            f"{{h}} wrapped the {animal} in {{hp}} {{thing}} to keep it warm.",
            f"{{h}} and {{f}} gave the {animal} some water and food.",
        ),
        (f"Every day, {{h}} took care of the {animal}.", f"{{h}} sang softly to the {animal}."),
        (f"Soon, the {animal} was strong again.", f"After a few days, the {animal} felt much better."),
        (
            f"One morning, the {animal} went back to its family.",
            f"The {animal} said goodbye and ran back home.",
            f"Then the {animal} found its mom.",
        ),
        ("{h} felt a little sad, but also very {good}.", "{h} waved goodbye and smiled."),
    ], ("{h} learned that being kind to animals is important.", "It feels good to help others."))


def plot_race(rng: random.Random, ctx: StoryContext) -> list[str]:
    return tell(rng, ctx, [
        ("One day, {h} and {f} had a race at the {place}.", '{f} said to {h}, "Let\'s race to {high}!"'),
        ("Ready, set, go! They ran as fast as they could.", "They counted to three and started to run."),
        ("{h} was winning, but then {f} tripped and fell.", "Halfway there, {f} fell down and hurt {fp} knee."),
        Say(("Ouch! My knee hurts!", "Help! I fell down!"), "f"),
        ("{h} could win the race, but {hs} stopped.", "{h} looked at the finish, then looked back at {f}."),
        ("{Hs} ran back to help {fo}.", "{Hs} went back and helped {f} stand up."),
        Say(("Are you okay, {f}? Let's finish together.", "Winning is not important. You are my friend."), "h"),
        ("They walked to the finish together, holding hands.", "Together, they crossed the finish line."),
        ("Everyone clapped for them.", "{f} smiled and said thank you."),
    ], ("{h} learned that friends are more important than winning.", "Being kind is better than being first."))


def plot_new_friend(rng: random.Random, ctx: StoryContext) -> list[str]:
    return tell(rng, ctx, [
        ("{h} lived near the {place}, but {hs} had no friends there.", "{h} was new in town and felt {bad}."),
        ("Every day, {hs} played alone with {hp} {thing}.", "{Hs} wished {hs} had someone to play with."),
        ("One day, {hs} saw {f} the {fk} sitting alone near {hide}.", "One day, a {fk} named {f} came to the {place}."),
        ("{f} looked shy.", "{f} looked {bad} too."),
        ("{h} wanted to say hello, but {hs} was nervous.", "{h} took a deep breath and walked over."),
        Say(("Hi, I am {h}. Do you want to play with me?", "Hello! Do you like to {act}?"), "h", question=True),
        Say(("Yes, I would love to!", "Yes! My name is {f}.", "Really? Yes, please!"), "f"),
        ("They played with the {adj} {thing} all afternoon.", "They loved to {act} together."),
        ("Soon, they were the best of friends.", "{h} was not {bad} anymore."),
    ], ("Sometimes a new friend is just one hello away.", "{h} learned that it is good to be brave and say hello."))
