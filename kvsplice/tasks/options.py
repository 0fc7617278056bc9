"""The options of a task evaluation (``eval_tasks``) as one typed object, built from the command line by
:func:`kvsplice.cli.eval_tasks.options` and passed down instead of the parser's namespace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsplice.core.limits import MAX_TOKENS, check_count, check_threads
from kvsplice.io.run_options import RunOptions

__all__ = ["EvalTasksOptions"]


@dataclass(frozen=True)
class EvalTasksOptions(RunOptions):
    """What ``eval_tasks`` runs: the model, the methods (``plans``, ``methods``: specs of
    :mod:`kvsplice.tasks.methods`), the instances (tasks × lengths × ``n`` seeds from ``seed0``, in ``setting``),
    the door and where the results go (``out``, resumed unless ``force``; ``md``)."""

    model: str
    out: str
    tokenizer: Optional[str] = None
    plans: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ("passkey", "niah_number_stories", "vartrack")
    lengths: tuple[int, ...] = (1024,)
    n: int = 8
    seed0: int = 0
    setting: str = "both"
    stories: Optional[str] = None
    door: str = "decoder"
    md: Optional[str] = None

    def __post_init__(self) -> None:
        """Counts within their bounds and ``--threads`` within the CPUs, before the model loads (one line)."""
        for length in self.lengths:
            check_count("--lengths", length, 1, MAX_TOKENS)
        check_count("--n", self.n, 1, MAX_TOKENS)
        check_threads("--threads", self.threads)

    @property
    def settings(self) -> tuple[str, ...]:
        """The settings run: ``agnostic``, ``aware`` or both."""
        from kvsplice.tasks.instance import SETTINGS

        return SETTINGS if self.setting == "both" else (self.setting,)
