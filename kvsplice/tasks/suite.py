"""The task suite by name: every generator with its settings, and :func:`make_instance` / :func:`make_instances`.

An instance is a function of ``(task, length, seed)``: its ``random.Random`` is seeded with that string, so the same
seed gives the same text on any machine, and tuning (the planner: :data:`TUNING_SEED0` upwards) never shares an
instance with a reported run (seeds from 0).
"""

from __future__ import annotations

import functools
import random
from typing import Callable, Optional, Sequence

from kvsplice.tasks.common_words import common_words
from kvsplice.tasks.haystack import HAYSTACKS
from kvsplice.tasks.instance import TaskInstance, prompt_ids
from kvsplice.tasks.needles import multikey, multiquery, multivalue, passkey, single
from kvsplice.tasks.story_qa import story_qa
from kvsplice.tasks.variables import variable_tracking

__all__ = ["DEFAULT_TASKS", "MIN_LENGTH", "NEEDS_STORIES", "TASKS", "TUNING_SEED0", "check_instances", "check_lengths",
           "check_positions", "make_instance", "make_instances"]

TUNING_SEED0 = 1_000_000
"""Seeds at or above this are tuning instances (the planner's); reported runs use seeds below it."""


def _grid() -> dict[str, Callable[..., TaskInstance]]:
    tasks: dict[str, Callable[..., TaskInstance]] = {"passkey": passkey}
    for value in ("number", "word", "uuid"):
        for hay in HAYSTACKS:
            tasks[f"niah_{value}_{hay}"] = functools.partial(single, value=value, haystack=hay)
    for hay in HAYSTACKS:
        tasks[f"multikey_{hay}"] = functools.partial(multikey, haystack=hay)
    tasks["multivalue"] = functools.partial(multivalue, haystack="facts")
    tasks["multiquery"] = functools.partial(multiquery, haystack="stories")
    tasks["vartrack"] = variable_tracking
    tasks["common_words"] = common_words
    tasks["story_qa"] = story_qa
    return tasks


TASKS: dict[str, Callable[..., TaskInstance]] = _grid()
"""Task name → generator ``(tokenizer, length, seed, rng, *, task, stories) -> TaskInstance``."""
NEEDS_STORIES = frozenset(n for n in TASKS if "stories" in n or n in ("multiquery", "story_qa"))
"""Tasks whose text comes from the TinyStories file (``stories=``)."""
DEFAULT_TASKS = ("passkey", "niah_number_stories", "niah_uuid_facts", "multikey_stories", "multivalue", "multiquery",
                 "vartrack", "common_words", "story_qa")


MIN_LENGTH = 64
"""The shortest prompt (tokens) a task instance is generated at."""


def make_instance(task: str, tokenizer, length: int, seed: int, *, stories: Optional[str] = None) -> TaskInstance:
    """Instance ``seed`` of ``task`` whose prompt is ``length`` tokens of ``tokenizer`` (at most; within a
    haystack piece of it)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks are {', '.join(TASKS)}")
    if length < MIN_LENGTH:
        raise ValueError(f"length must be >= {MIN_LENGTH} tokens, got {length}")
    rng = random.Random(f"{task}/{length}/{seed}")
    inst = TASKS[task](tokenizer, length, seed, rng, task=task, stories=stories)
    ctx, q = prompt_ids(tokenizer, inst)
    inst.meta["n_tokens"] = len(ctx) + len(q)
    return inst


def make_instances(tasks: Sequence[str], tokenizer, lengths: Sequence[int], n: int, *, seed0: int = 0,
                   stories: Optional[str] = None) -> list[TaskInstance]:
    """``n`` instances (seeds ``seed0 .. seed0 + n - 1``) of every task at every length, seed by seed (a run cut
    short has every task at its first seeds)."""
    return [make_instance(t, tokenizer, L, seed0 + i, stories=stories) for i in range(n) for t in tasks
            for L in lengths]


def check_positions(insts: Sequence[TaskInstance], max_positions: Optional[int]) -> None:
    """Every instance's prompt *and* its answer fit the model's ``max_positions`` (``None``: no limit): a prompt that
    fills the positions leaves none to answer in. A ``ValueError`` names the task, the length and the longest length
    that leaves room for that task's answer."""
    over = [i for i in insts if max_positions is not None and i.length + i.max_new_tokens > max_positions]
    if over:
        i = max(over, key=lambda i: i.length + i.max_new_tokens)
        raise ValueError(f"{i.task} at length {i.length}: its prompt + {i.max_new_tokens} answer tokens exceed the "
                         f"model's {max_positions} positions (give lengths of at most "
                         f"{max_positions - i.max_new_tokens})")


def check_lengths(insts: Sequence[TaskInstance]) -> None:
    """Every instance's prompt fits its length (what the docs promise: prompts no longer than the length). A task's
    needles and question alone may be longer than a short length; a ``ValueError`` then names the task, the length
    and the shortest length that holds the prompts of these seeds."""
    over: dict[tuple[str, int], int] = {}
    for inst in insts:
        n = inst.meta.get("n_tokens", 0)
        if n > inst.length:
            over[inst.task, inst.length] = max(n, over.get((inst.task, inst.length), 0))
    if over:
        (task, length), n = min(over.items(), key=lambda kv: kv[0][1])
        raise ValueError(f"{task} at length {length} builds prompts of up to {n} tokens (its needles and question "
                         f"alone); give lengths of at least {n} for {task}")


def fitting_instances(tasks: Sequence[str], tokenizer, length: int, n: int, *, seed0: int = 0,
                      stories: Optional[str] = None) -> tuple[int, list[TaskInstance]]:
    """``n`` instances of every task at ``length`` or, when a task's needles and question alone need more, at the
    shortest length that holds every prompt (a default length that works by itself); returns it and them."""
    for _ in range(4):  # a longer haystack holds the same needles: one raise settles it, the rest is a guard
        insts = make_instances(tasks, tokenizer, [length], n, seed0=seed0, stories=stories)
        need = max(i.meta.get("n_tokens", 0) for i in insts)
        if need <= length:
            break
        length = need
    return length, insts


def check_instances(insts: Sequence[TaskInstance], max_positions: Optional[int]) -> None:
    """The one bound check of task instances, wherever they are made (``eval_tasks --lengths``, the planner's
    ``--tune-length``): each prompt fits its length (:func:`check_lengths`) and, with its answer, the model's
    positions (:func:`check_positions`); a one-line ``ValueError`` otherwise."""
    check_lengths(insts)
    check_positions(insts, max_positions)
