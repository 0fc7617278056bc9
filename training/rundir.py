"""Run directories: where a ``python -m training.fit`` run writes, without ever destroying an earlier run.

A run lives in ``<runs_dir>/<run_name>/``. What happens when that directory already holds a run (any file in it):

* a **new run** (no ``--ckpt_path``) goes to the first free ``<run_name>-v1``, ``-v2``, ... (like Lightning's
  ``version_N`` logs and ``last-v1.ckpt`` checkpoints) and says so on stderr; ``--overwrite`` instead replaces the
  earlier run's files in ``<run_name>/`` (only once training really starts: a run refused for a bad option or bad
  data deletes nothing);
* a **resume** (``--ckpt_path last|best|<file in the run dir>``) continues ``<run_name>/``: its ``config.yaml`` is kept
  (a resume with changed options records them in ``config.resume-<step>.yaml``), ``metrics.csv`` keeps the rows before
  the checkpoint's step and gets the rest appended, the offline W&B run id stored in ``wandb_id.txt`` is reused;
* ``--ckpt_path last`` in a run directory without any checkpoint starts that run from scratch there (so an
  auto-resume loop that always passes ``--ckpt_path last`` works from its first attempt);
* ``--ckpt_path <file elsewhere>`` starts a new run from that checkpoint's state (placed like a new run).

No config file ever records ``ckpt_path`` or ``overwrite``: re-running a saved ``config.yaml`` is a new run.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["CLIConfigError", "RUN_NAME", "WANDB_ID_FILE", "RunPlan", "check_run_name", "clear_run_files",
           "next_free_run_dir", "plan_run", "run_dir_in_use"]

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")
WANDB_ID_FILE = "wandb_id.txt"
"""Holds the run's W&B run id, so a resumed run continues the same (offline) W&B run."""
_VERSION = re.compile(r"^(?P<base>.+)-v(?P<n>\d+)$")


class CLIConfigError(ValueError):
    """A CLI-level setting is invalid: ``--config`` names no file, a bad ``--run_name``, ``--torch_threads < 1``,
    ``--ckpt_path best`` without a best checkpoint..."""


def check_run_name(name: str) -> str:
    if not isinstance(name, str) or not RUN_NAME.match(name):
        raise CLIConfigError(f"--run_name {name!r}: use letters, digits and . _ - = + (no slashes)")
    return name


def run_dir_in_use(path: Path) -> bool:
    """Whether ``path`` exists and holds anything (then a new run must not write into it)."""
    if not path.exists():
        return False
    if not path.is_dir():
        return True
    return any(path.iterdir())


def next_free_run_dir(runs_dir: Path, name: str) -> Path:
    """``<runs_dir>/<base>-v<k>`` with the smallest ``k >= 1`` not in use (``base`` = ``name`` without a ``-vN``
    suffix, so re-running ``NAME-v1``'s config gives ``NAME-v2``, not ``NAME-v1-v1``)."""
    m = _VERSION.match(name)
    base = m["base"] if m else name
    k = 1
    while run_dir_in_use(runs_dir / f"{base}-v{k}"):
        k += 1
    return runs_dir / f"{base}-v{k}"


@dataclass
class RunPlan:
    """Where a run writes and how.

    Attributes:
        run_dir: the run directory.
        ckpt_path: the checkpoint to load (resolved path), or ``None`` for a run from scratch.
        resume: continue ``run_dir``'s run (keep its config, trim + append its metrics, reuse its W&B id).
        clear: ``--overwrite``: remove the earlier run's files from ``run_dir`` when training starts.
        notes: one-line messages for stderr (where the run goes and why).
    """

    run_dir: Path
    ckpt_path: Optional[str] = None
    resume: bool = False
    clear: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def run_name(self) -> str:
        return self.run_dir.name


def _newest(paths: list[Path]) -> Optional[Path]:
    return max(paths, key=lambda p: p.stat().st_mtime) if paths else None


def plan_run(runs_dir: str | Path, run_name: str, ckpt_path: Optional[str], overwrite: bool) -> RunPlan:
    """Decide the run directory (see the module docstring). Creates and deletes nothing.

    Raises:
        CLIConfigError: ``--overwrite`` with ``--ckpt_path``, ``--runs_dir`` is a file, ``--ckpt_path best`` without a
            best checkpoint, ``--ckpt_path last`` in a directory whose checkpoints include no ``last*.ckpt``.
    """
    runs = Path(runs_dir).expanduser()
    if runs.exists() and not runs.is_dir():
        raise CLIConfigError(f"--runs_dir {str(runs_dir)!r} is a file, not a folder")
    check_run_name(run_name)
    named = runs / run_name
    if named.exists() and not named.is_dir():
        raise CLIConfigError(f"run directory {named} is a file; choose another --run_name or --runs_dir")

    if ckpt_path is not None and overwrite:
        raise CLIConfigError("--overwrite starts a new run and --ckpt_path resumes one: give only one of them")

    if ckpt_path in ("last", "best"):
        pattern = "last*.ckpt" if ckpt_path == "last" else "best-*.ckpt"
        found = _newest(sorted(named.glob(pattern))) if named.is_dir() else None
        if found is not None:
            return RunPlan(named, str(found), resume=True, notes=[f"resuming {named} from {found.name}"])
        if ckpt_path == "best":
            raise CLIConfigError(f"--ckpt_path best: no best-*.ckpt in {named}")
        others = sorted(named.glob("*.ckpt")) if named.is_dir() else []
        if others:
            raise CLIConfigError(f"--ckpt_path last: {named} has no last.ckpt (it has {others[0].name}); pass "
                                 f"--ckpt_path best or a checkpoint file")
        why = "holds no checkpoint yet" if named.is_dir() else "does not exist yet"
        return RunPlan(named, None, resume=False,
                       notes=[f"--ckpt_path last: {named} {why}; starting this run from scratch there"])

    if ckpt_path is not None:
        ckpt = Path(ckpt_path).expanduser()
        if ckpt.parent.resolve() == named.resolve():  # a checkpoint of this run: resume it
            return RunPlan(named, str(ckpt), resume=True, notes=[f"resuming {named} from {ckpt.name}"])
        plan = _new_run(runs, run_name, named, overwrite=False)
        plan.ckpt_path = str(ckpt)
        plan.notes.append(f"starting a new run in {plan.run_dir} from the state of {ckpt}")
        return plan
    return _new_run(runs, run_name, named, overwrite)


def _new_run(runs: Path, run_name: str, named: Path, overwrite: bool) -> RunPlan:
    if not run_dir_in_use(named):
        return RunPlan(named, notes=[f"run directory: {named}"])
    if overwrite:
        return RunPlan(named, clear=True, notes=[f"--overwrite: replacing the earlier run in {named}"])
    new = next_free_run_dir(runs, run_name)
    return RunPlan(new, notes=[f"{named} holds an earlier run, kept as is; this run writes to {new} "
                               f"(--overwrite replaces the earlier run, --ckpt_path last resumes it)"])


#: What a run writes into its directory (``--overwrite`` removes exactly these; other files are left alone).
RUN_FILE_GLOBS = ("*.ckpt", "config.yaml", "config.resume-*.yaml", "metrics.csv", "hparams.yaml", WANDB_ID_FILE,
                  ".*.tmp")


def clear_run_files(run_dir: Path) -> list[Path]:
    """Remove an earlier run's files (checkpoints, configs, metrics, W&B folder...) from ``run_dir``."""
    removed: list[Path] = []
    for pattern in RUN_FILE_GLOBS:
        for f in run_dir.glob(pattern):
            if f.is_file() or f.is_symlink():
                f.unlink()
                removed.append(f)
    wandb_dir = run_dir / "wandb"
    if wandb_dir.is_dir():
        shutil.rmtree(wandb_dir)
        removed.append(wandb_dir)
    return removed
