"""The planner's tuning task instances as a :class:`~kvsplice.planning.search.TaskBench`: each instance's exact
prefill made once and kept (:class:`~kvsplice.tasks.shared.SharedPrefill`), so candidates measured one after
another — in order of tuning perplexity, each stopped once it cannot win — pay only their own compression and
answer. Each instance's per-context work (KVzip's reconstruction scores, its mixed-in selector's votes) is kept too,
for every candidate and round. Prefills past ``keep_bytes`` are not kept (made again when used; the scores are).
"""

from __future__ import annotations

import sys
from typing import Callable, Iterator, Optional, Sequence

from tqdm.auto import tqdm

from kvsplice.tasks.instance import TaskInstance
from kvsplice.tasks.shared import SharedPrefill

__all__ = ["KEEP_BYTES", "TuningTasks"]

KEEP_BYTES = 4 << 30
"""Kept prefills at most (bytes): SmolLM2-135M's 1,024-token instance holds about 120 MB of ``q, k, v``."""


class TuningTasks:
    """``instances`` answered by ``model`` in ``setting``; scores are each instance's (``score_only`` answers:
    stopped once settled)."""

    def __init__(self, model, tokenizer, instances: Sequence[TaskInstance], *, setting: str = "agnostic",
                 progress: bool = True, keep_bytes: int = KEEP_BYTES) -> None:
        self.model, self.tokenizer, self.instances, self.setting = model, tokenizer, list(instances), setting
        self.n = len(self.instances)
        if not self.n:
            raise ValueError("tuning tasks need at least one instance")
        self.keep_bytes = keep_bytes
        self._kept: dict[int, SharedPrefill] = {}
        self._contexts: list[dict] = [{} for _ in self.instances]  # per instance: work its methods share
        self._full_acc: Optional[float] = None  # set once every instance's full cache has answered
        self.progress = progress
        self._bar: Optional[tqdm] = None  # made on the first answer (not while the planner calibrates)

    def _tick(self, label: Optional[str] = None) -> None:
        if self._bar is None:
            self._bar = tqdm(desc="tuning tasks", unit="answer", disable=not self.progress, file=sys.stderr)
        if label is not None:
            self._bar.set_postfix_str(label[:40], refresh=False)
        else:
            self._bar.update()

    def _prefill(self, i: int) -> SharedPrefill:
        one = self._kept.get(i)
        if one is None:
            one = SharedPrefill(self.model, self.tokenizer, self.instances[i], setting=self.setting,
                                shared=self._contexts[i])
            if self._full_acc is not None:  # answered already: only the kept prefill is needed
                one.drop_full_cache()
            if sum(p.nbytes for p in self._kept.values()) + one.nbytes <= self.keep_bytes:
                self._kept[i] = one
        return one

    def full(self) -> float:
        """The full cache's accuracy (%), answered once per instance."""
        if self._full_acc is None:
            got = 0.0
            for i in range(self.n):
                got += self._prefill(i).full(score_only=True).score
                self._tick()
            self._full_acc = 100 * got / self.n
        return self._full_acc

    def scores(self, factory: Callable, label: str = "") -> Iterator[float]:
        """Instance by instance, the score of the method ``factory(ids[, shared])`` builds."""
        self._tick(label)
        for i in range(self.n):
            score = self._prefill(i).answer(factory, score_only=True).score
            self._tick()
            yield score

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
