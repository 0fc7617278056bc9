"""Question answering over real prose: the name of a character introduced early in a TinyStories story ("... a little
girl named Lily ...") that opens the context, followed by other stories (none naming a character the same way), then
"In the first story, what was the name of the little girl? The little girl was named". The fact is stated once,
early, in natural text — what a cache that forgets early prose loses."""

from __future__ import annotations

import random
import re
from typing import Optional

from kvsplice.tasks.haystack import build_context, haystack_pieces, load_stories
from kvsplice.tasks.instance import TaskInstance

__all__ = ["story_qa"]

_NAMED = re.compile(r"\b(?:a|an) ((?:little |big |small |old |young |kind |happy |brave )?[a-z]+) named ([A-Z][a-z]+)")


def story_qa(tokenizer, length: int, seed: int, rng: random.Random, *, task: str, stories: Optional[str] = None,
             **_) -> TaskInstance:
    if stories is None:
        raise ValueError("story_qa needs a TinyStories file (stories=PATH / --stories)")
    paras = load_stories(str(stories))
    firsts = [(p, m) for p in paras if (m := _NAMED.search(p[:400])) is not None]
    if not firsts:
        raise ValueError(f"{stories}: no story introduces a character as 'a ... named X'")
    story, m = firsts[rng.randrange(len(firsts))]
    who, name = m.group(1), m.group(2)
    q = f"\n\nIn the first story, what was the name of the {who}? The {who} was named"
    budget = length - len(tokenizer.encode(q)) - (1 if tokenizer.sep == "bos" else 0)
    pieces = haystack_pieces("stories", rng, stories, keep=lambda p: " named " not in p and name not in p)
    ctx = build_context(tokenizer, pieces, budget, [(0.0, story)],
                        "Read the following stories. I will ask you about the first one afterwards.\n\n")
    return TaskInstance(task, length, seed, ctx, q, (name,), 6, {"who": who, "haystack": "stories"})
