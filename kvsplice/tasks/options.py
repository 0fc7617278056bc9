"""The options of a task evaluation (``eval-tasks``) as one typed object: the declaration of its command line too
(each field's flag, help and parser: :mod:`kvsplice.io.options`), passed down instead of the parser's namespace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsplice.core.limits import MAX_TOKENS, check_count, check_threads
from kvsplice.io.cli import pos_int
from kvsplice.io.options import opt
from kvsplice.io.run_options import RunOptions
from kvsplice.tasks.suite import TASKS

__all__ = ["EvalTasksOptions"]

DEFAULT_TASKS = ("passkey", "niah_number_stories", "vartrack")
"""``eval-tasks``' default tasks: a number in filler, a number in real prose, variable tracking."""


@dataclass(frozen=True)
class EvalTasksOptions(RunOptions):
    """What ``eval-tasks`` runs: the model, the methods (``plans``, ``methods``: specs of
    :mod:`kvsplice.tasks.methods`), the instances (tasks × lengths × ``n`` seeds from ``seed0``, in ``setting``),
    the door and where the results go (``out``, resumed unless ``force``; ``md``). The fields declare the command
    line, in this order."""

    model: str = opt(help="model directory, .gguf file, training .ckpt or Hub id")
    tokenizer: Optional[str] = opt(None, help="override the model's tokenizer")
    plans: tuple[str, ...] = opt((), flags=("--plan",), metavar="PLAN", help="plans from kvsplice plan")
    methods: tuple[str, ...] = opt((), flags=("--method",), metavar="METHOD", help="method specs: any "
                                   "kvsplice.build_method spec (int8, kivi4, kivi_rotated(bits=4), "
                                   "select:NAME@KEEP[+STORE], lowrank:FILE+int8, spec.json), kivi4h(residual=32), "
                                   "select:kvzip@x4+int8")
    tasks: tuple[str, ...] = opt(DEFAULT_TASKS, choices=sorted(TASKS), metavar="TASK", help=f"tasks (default "
                                 f"{' '.join(DEFAULT_TASKS)}; all: {' '.join(TASKS)})")
    lengths: tuple[int, ...] = opt((1024,), parse=pos_int, help="prompt lengths in tokens (default 1024)")
    n: int = opt(8, parse=pos_int, help="instances per task and length (default 8)")
    seed0: int = opt(0, help="first instance seed (default 0; tuning uses >= 1,000,000)")
    setting: str = opt("both", choices=("agnostic", "aware", "both"), help="query-agnostic, query-aware or both "
                       "(default both)")
    stories: Optional[str] = opt(None, help="TinyStories text for the stories haystacks and story QA")
    door: str = opt("decoder", choices=("decoder", "hf"), help="the package's Decoder (default; one shared prefill "
                    "for every selection) or transformers' generate()")
    out: str = opt(help="results JSON (resumed when it exists)")
    md: Optional[str] = opt(None, help="also write the tables as markdown here")

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
