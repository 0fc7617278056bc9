"""The options of a ``kvsplice distill`` run as one typed object: the declaration of its command line too (each
field's flag, help and parser: :mod:`kvsplice.io.options`), checked when made — before any model loads — and passed
down instead of the parser's namespace."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional

from kvsplice.core.limits import MAX_LEARNING_RATE
from kvsplice.io.cli import pos_int
from kvsplice.io.options import opt
from training.lit_distill import LOSSES, TRAINABLE

__all__ = ["DistillOptions", "SELF_TOKENS_MINUTES"]

SELF_TOKENS_MINUTES = 131_072
"""The self-text corpus of a run bounded by minutes (steps cycle over it)."""

TEMPERATURE = 1.0
"""The KL temperature when ``--temperature`` is not given."""


def _minutes(text: str) -> float:
    """argparse type: minutes, a finite number > 0."""
    v = float(text)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number of minutes > 0, got {text}")
    return v


def _steps(s: str) -> int:
    """argparse type: a whole number of steps >= 0 (-1 warm-up steps ran without a word)."""
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def _positive(s: str) -> float:
    """argparse type: a finite number > 0 (``0`` / ``nan`` / ``inf`` refused before anything loads)."""
    v = float(s)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


@dataclass(frozen=True)
class DistillOptions:
    """What ``distill`` trains (``model``, from ``teacher`` with ``loss``), on what (``data``, else the teacher's own
    text: ``self_tokens`` cached in ``cache_dir``), how long (``minutes`` / ``max_steps``), how (``batch_size``
    windows of ``seq_len``, ``lr``, ``warmup_steps``, ``temperature``, ``trainable``) and where its run goes
    (``runs_dir`` / ``run_name``, ``ckpt_path`` to resume). The fields declare the command line, in this order."""

    model: str = opt(help="a converted MLA model folder (kvsplice to-mla), or an unconverted transformers model / "
                     "GGUF file (the same-text baseline)")
    teacher: Optional[str] = opt(None, help="the source model (folder / GGUF) for --loss kl")
    data: Optional[str] = opt(None, flags=("--data", "--data.path"), help="training text (.txt/.json/.jsonl); "
                              "default: the teacher's own text (generated once, cached)")
    self_tokens: Optional[int] = opt(None, parse=pos_int, help=f"tokens of the teacher's own text (default: enough "
                                     f"for --max-steps, {SELF_TOKENS_MINUTES:,} with --minutes; not with --data)")
    cache_dir: Optional[str] = opt(None, help="where the teacher's text is cached (default: "
                                   "$XDG_CACHE_HOME/kvsplice/self_text or ~/.cache/kvsplice/self_text; not with "
                                   "--data)")
    loss: str = opt("kl", choices=LOSSES, help="kl: distil from --teacher (default); lm: LM loss")
    minutes: Optional[float] = opt(None, parse=_minutes, help="time budget: stop after M minutes of training")
    snapshot_minutes: tuple[float, ...] = opt((), parse=_minutes, metavar="M", help="write RUN/model-<M>min/ at "
                                              "these minutes of training")
    max_steps: Optional[int] = opt(None, parse=pos_int, help="default: 60 without --minutes, else unbounded")
    batch_size: int = opt(2, parse=pos_int, help="windows of the first --seq-len per step")
    seq_len: Optional[tuple[int, ...]] = opt(None, parse=pos_int, metavar="T", help="window lengths, alternating by "
                                             "step (default: 1024 2048 within the model's positions)")
    trainable: str = opt("all", choices=TRAINABLE, help="all parameters, or the attention only")
    tokens: Optional[int] = opt(None, parse=pos_int, help="training tokens read from --data (default: enough for "
                                "max-steps batches; more than --data holds is refused)")
    val_tokens: int = opt(4096, parse=pos_int, help="held-out tokens")
    lr: float = opt(2e-4, parse=_positive, help="peak learning rate, a finite number > 0 (default 2e-4)")
    warmup_steps: Optional[int] = opt(None, parse=_steps, help="default: 10% of --max-steps (10 with --minutes)")
    temperature: Optional[float] = opt(None, parse=_positive, help=f"KL temperature, a finite number > 0 (default "
                                       f"{TEMPERATURE:g}; --loss kl only)")
    val_every: int = opt(20, parse=pos_int, help="validate every N steps")
    devices: int = opt(1, parse=pos_int, help="processes (GPUs) with Lightning's DDP")
    precision: Optional[str] = opt(None, help="Lightning precision (default: bf16-mixed on CUDA, else 32)")
    runs_dir: str = opt("checkpoints", help="the folder of the runs (default checkpoints)")
    run_name: Optional[str] = opt(None, help="default: distill-<model folder name>")
    ckpt_path: Optional[str] = opt(None, help="last | best | a checkpoint file: resume")
    overwrite: bool = opt(False, help="start the run folder over")
    seed: int = opt(0, help="random seed (default 0)")
    threads: Optional[int] = opt(None, parse=pos_int, help="torch threads (default: torch's)")
    progress: bool = opt(True, flags=("--no-progress",), help="no progress bar")

    def __post_init__(self) -> None:
        """Refuse, naming the option, what would fail late or do nothing (before any model loads)."""
        for option, value in (("--lr", self.lr), ("--temperature", self.temperature)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not (value > 0 and math.isfinite(value))):
                raise ValueError(f"{option} must be a finite number > 0, got {value}")
        if self.lr > MAX_LEARNING_RATE:
            raise ValueError(f"--lr {self.lr:g} is above {MAX_LEARNING_RATE:g}: every step would move each weight by "
                             f"more than its size (usual: 1e-5 to 1e-2)")
        if self.temperature is not None and self.loss != "kl":
            raise ValueError(f"--temperature is the KL's; with --loss {self.loss} it does nothing (leave it out, or "
                             f"use --loss kl)")
        if self.data is not None:
            for option, value in (("--self-tokens", self.self_tokens), ("--cache-dir", self.cache_dir)):
                if value is not None:
                    raise ValueError(f"{option} sizes / places the teacher's own text; with --data it does nothing "
                                     f"(leave it out, or leave --data out)")

    @property
    def kl_temperature(self) -> float:
        """The KL temperature: ``temperature``, else :data:`TEMPERATURE`."""
        return TEMPERATURE if self.temperature is None else self.temperature
