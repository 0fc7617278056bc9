"""``metrics.csv`` for a run directory that also holds checkpoints, correct across resumes.

:class:`RunCSVLogger` is Lightning's ``CSVLogger`` writing ``metrics.csv`` / ``hparams.yaml`` straight into the run
directory. Unlike ``CSVLogger`` it never deletes an existing ``metrics.csv`` at start-up (the run directory is chosen so
that a new run never meets an earlier run's file, see :mod:`training.rundir`), and :meth:`RunCSVLogger.resume_at`
makes a resumed run keep exactly the rows logged before its checkpoint's step: rows a killed run wrote after that
checkpoint are dropped at the first save, so every step appears once. The file is rewritten atomically (temporary file
+ rename); :meth:`RunCSVLogger.save` is also called whenever a checkpoint is saved, so rows up to a checkpoint are on
disk before it is (nothing is lost when a run is killed after that checkpoint).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["RunCSVLogger", "RunMetricsWriter"]


def _step(row: dict[str, str]) -> Optional[int]:
    value = row.get("step")
    try:
        return int(float(value)) if value not in (None, "") else None
    except ValueError:
        return None


class RunMetricsWriter(ExperimentWriter):
    """``metrics.csv`` writer that appends to an existing file and can drop rows from a step on (resume)."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self._keep_below: Optional[int] = None
        if os.path.isfile(self.metrics_file_path):  # continue the file's columns
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = sorted(csv.DictReader(f).fieldnames or [])

    def _check_log_dir_exists(self) -> None:
        pass  # never delete: the run directory was chosen so that an existing metrics.csv is this run's own

    def keep_rows_below(self, step: int) -> None:
        """At the next :meth:`save`, drop every stored row with ``step >= step`` (rows a killed run logged after the
        checkpoint this run resumes from)."""
        self._keep_below = int(step)

    def _write_rows(self, rows: list[dict[str, Any]], keys: list[str]) -> None:
        from models.checkpoint import atomic_write

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=keys)
                writer.writeheader()
                writer.writerows(rows)

        atomic_write(self.metrics_file_path, write)

    def _read_rows(self) -> tuple[list[dict[str, str]], list[str]]:
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            return list(reader), list(reader.fieldnames or [])

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        rows, _ = self._read_rows()
        self._write_rows(rows, fieldnames)

    def save(self) -> None:
        if self._keep_below is not None and os.path.isfile(self.metrics_file_path):
            rows, keys = self._read_rows()
            kept = [r for r in rows if (s := _step(r)) is None or s < self._keep_below]
            if len(kept) != len(rows):
                self._write_rows(kept, keys)
        self._keep_below = None
        super().save()


class RunCSVLogger(CSVLogger):
    """CSVLogger writing ``metrics.csv`` / ``hparams.yaml`` straight into the run directory ``save_dir``."""

    def __init__(self, save_dir: str) -> None:
        super().__init__(save_dir=save_dir, name="", version="")

    @property
    def log_dir(self) -> str:
        return self.save_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> RunMetricsWriter:
        if self._experiment is None:
            os.makedirs(self.save_dir, exist_ok=True)
            self._experiment = RunMetricsWriter(self.save_dir)
        return self._experiment

    @rank_zero_only
    def resume_at(self, step: int) -> None:
        """This run continues from optimizer step ``step``: keep only the file's rows logged before it."""
        self.experiment.keep_rows_below(step)
        self.experiment.save()
