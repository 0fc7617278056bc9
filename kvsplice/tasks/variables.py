"""Variable tracking (RULER's ``vt``): a chain of assignments ``VAR A = 12345. ... VAR B = VAR A. ...`` hidden in the
filler, with distractor chains of other values; the question asks which variables hold the chain's value. Every
variable of the chain must be named (multi-hop tracing across the context)."""

from __future__ import annotations

import random
import string

from kvsplice.tasks.haystack import build_context, haystack_pieces
from kvsplice.tasks.instance import TaskInstance

__all__ = ["variable_tracking"]


def _name(rng: random.Random, avoid: set[str]) -> str:
    while True:
        n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if n not in avoid:
            avoid.add(n)
            return n


def variable_tracking(tokenizer, length: int, seed: int, rng: random.Random, *, task: str, n_hops: int = 4,
                      n_chains: int = 2, haystack: str = "filler", stories=None, **_) -> TaskInstance:
    used: set[str] = set()
    values: list[int] = []
    chains: list[list[str]] = []
    for _ in range(n_chains):
        v = rng.randint(10_000, 99_999)
        while v in values:
            v = rng.randint(10_000, 99_999)
        values.append(v)
        chains.append([_name(rng, used) for _ in range(n_hops + 1)])
    inserts = []
    for v, names in zip(values, chains):
        depths = sorted(rng.random() for _ in names)  # a chain's assignments in order of the chain
        inserts += [(depths[0], f"VAR {names[0]} = {v}.")]
        inserts += [(d, f"VAR {b} = VAR {a}.") for d, a, b in zip(depths[1:], names, names[1:])]
    inserts.sort(key=lambda x: x[0])
    q = (f"\n\nFind all variables that are assigned the value {values[0]} in the text above. Answer: According to the "
         f"chain of variable assignments in the text above, {n_hops + 1} variables are assigned the value "
         f"{values[0]}, they are:")
    budget = length - len(tokenizer.encode(q)) - (1 if tokenizer.sep == "bos" else 0)
    ctx = build_context(tokenizer, haystack_pieces(haystack, rng, stories), budget, inserts,
                        "Memorize and track the chain of variable assignments hidden in the following text.\n\n")
    return TaskInstance(task, length, seed, ctx, q, tuple(chains[0]), 8 * (n_hops + 1),
                        {"value": values[0], "haystack": haystack})
