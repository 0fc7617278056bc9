"""The time budget of ``kvsplice distill --minutes M``: a Lightning callback that owns the run's training clock.

It stops the run once ``M`` minutes of training have passed (``trainer.should_stop``: Lightning then validates, and
the checkpoint callback writes ``last.ckpt``), writes the model folder at the ``--snapshot-minutes`` marks
(``RUN/model-15min/`` ...; a mark at or past the budget is ``RUN/model/`` itself), and keeps ``curve.csv``: minutes,
step, tokens, held-out KL and LM loss at every validation. Its state (elapsed seconds, marks written, the curve) is
in the checkpoint, so a resumed run (``--ckpt-path last``) continues the clock, the snapshots and the curve.
The learning-rate schedule reads the clock (:func:`time_lr_factor`): linear warmup over steps, then cosine decay over
the fraction of the budget spent, so a run of any length ends at the low rate whatever its speed.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from lightning.pytorch.callbacks import Callback, TQDMProgressBar

__all__ = ["CURVE_FILE", "BudgetBar", "TimeBudget", "time_lr_factor"]

CURVE_FILE = "curve.csv"
CURVE_KEYS = ("minutes", "step", "tokens", "val_kl", "val_loss")


def time_lr_factor(step: int, progress: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak rate: ``(step + 1) / warmup_steps`` during warmup, times a cosine from 1 to
    ``min_lr_ratio`` over ``progress`` (the fraction of the time budget spent, clipped to [0, 1])."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    p = min(1.0, max(0.0, progress))
    return warm * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


class TimeBudget(Callback):
    """The training clock: budget, snapshots and curve. ``save_model(folder)`` writes a model folder (rank 0)."""

    def __init__(self, run_dir: Path, minutes: Optional[float] = None, snapshots: Sequence[float] = (),
                 save_model: Optional[Callable[[Path], None]] = None) -> None:
        self.run_dir, self.minutes = Path(run_dir), minutes
        self.snapshots = sorted(float(m) for m in snapshots if minutes is None or m < minutes)
        self.save_model = save_model
        self.before_s, self._t0 = 0.0, None  # seconds of earlier runs (resume), this run's start
        self.step_s = 0.0  # the clock at the start of the current step (rank 0's under DDP)
        self.written: list[float] = []
        self.curve: list[dict[str, Any]] = []

    @property
    def state_key(self) -> str:
        return "TimeBudget"

    def elapsed_s(self) -> float:
        return self.before_s + (time.monotonic() - self._t0 if self._t0 is not None else 0.0)

    def progress(self) -> float:
        """The fraction of the budget spent at the start of this step (0 without a budget)."""
        return self.step_s / (60.0 * self.minutes) if self.minutes else 0.0

    def minutes_left(self) -> Optional[float]:
        return max(0.0, self.minutes - self.step_s / 60.0) if self.minutes else None

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0 = time.monotonic()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # one clock for all DDP processes (rank 0's): the same learning rate, the same step to stop at
        self.step_s = self.elapsed_s()
        if trainer.world_size > 1:
            self.step_s = float(trainer.strategy.broadcast(self.step_s, src=0))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = self.elapsed_s() / 60.0
        if trainer.world_size > 1:
            m = float(trainer.strategy.broadcast(m, src=0))
        for mark in [s for s in self.snapshots if s <= m and s not in self.written]:
            if trainer.is_global_zero and self.save_model is not None:
                self.save_model(self.run_dir / f"model-{mark:g}min")
            self.written.append(mark)
        if self.minutes is not None and m >= self.minutes:
            trainer.should_stop = True  # Lightning validates at this step, then the checkpoint callback saves

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        got = trainer.callback_metrics
        row = {"minutes": round(self.elapsed_s() / 60.0, 4), "step": trainer.global_step,
               "tokens": int(getattr(pl_module, "tokens_seen", 0)),
               "val_kl": float(got["val_kl"]) if "val_kl" in got else "",
               "val_loss": float(got["val_loss"]) if "val_loss" in got else ""}
        self.curve = [r for r in self.curve if r["step"] < row["step"]] + [row]
        if trainer.is_global_zero:
            self._write_curve()

    def _write_curve(self) -> None:
        from models.checkpoint import atomic_write

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=CURVE_KEYS)
                w.writeheader()
                w.writerows(self.curve)

        atomic_write(self.run_dir / CURVE_FILE, write)

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed_s": self.elapsed_s(), "written": list(self.written), "curve": list(self.curve)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.before_s = self.step_s = float(state.get("elapsed_s", 0.0))
        self.written = [float(m) for m in state.get("written", [])]
        self.curve = list(state.get("curve", []))


class BudgetBar(TQDMProgressBar):
    """The progress bar of a run bounded by minutes: no step total (the minutes left are in its metrics)."""

    def __init__(self, bounded_by_minutes: bool) -> None:
        super().__init__()
        self._minutes = bounded_by_minutes

    @property
    def total_train_batches(self):  # type: ignore[override]
        return float("inf") if self._minutes else super().total_train_batches
