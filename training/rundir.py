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

One folder per run, even for runs started at the same moment: :func:`take_run_dir` creates the chosen folder and
holds an exclusive lock on its ``.run.lock`` for the whole run (the kernel drops it when the process dies). A folder
whose lock is held counts as in use, so a second run with the same name goes to ``-v1``; a resume or
``--overwrite`` of a folder in use is refused. :meth:`RunPlan.release` removes the lock file at the end, and the
folder too when the run wrote nothing into a folder it created.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["CLIConfigError", "LOCK_FILE", "RUN_DIR_ENV", "RUN_NAME", "WANDB_ID_FILE", "RunPlan", "check_run_name",
           "clear_run_files", "next_free_run_dir", "place_run", "plan_run", "run_dir_in_use", "take_run_dir"]

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")
WANDB_ID_FILE = "wandb_id.txt"
"""Holds the run's W&B run id, so a resumed run continues the same (offline) W&B run."""
LOCK_FILE = ".run.lock"
"""Locked (``flock``) by the process that runs in the folder, for as long as it runs."""
RUN_DIR_ENV = "KVSPLICE_RUN_DIR"
"""The folder rank 0 took, for the DDP processes it launches (they inherit its environment)."""
_VERSION = re.compile(r"^(?P<base>.+)-v(?P<n>\d+)$")


class CLIConfigError(ValueError):
    """A CLI-level setting is invalid: ``--config`` names no file, a bad ``--run_name``, ``--torch_threads < 1``,
    ``--ckpt_path best`` without a best checkpoint..."""


def check_run_name(name: str) -> str:
    if not isinstance(name, str) or not RUN_NAME.match(name):
        raise CLIConfigError(f"--run_name {name!r}: use letters, digits and . _ - = + (no slashes)")
    return name


def run_dir_in_use(path: Path) -> bool:
    """Whether ``path`` exists and holds anything (but a stale lock file), or a live run holds its lock (then a new
    run must not write into it)."""
    if not path.exists():
        return False
    if not path.is_dir():
        return True
    return _holds_files(path) or _locked(path / LOCK_FILE)


def _holds_files(path: Path) -> bool:
    """Whether the folder ``path`` holds anything but its lock file."""
    return any(p.name != LOCK_FILE for p in path.iterdir())


def _locked(lock: Path) -> bool:
    """Whether another process holds ``lock`` (probed with a shared non-blocking ``flock``)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own shared lock


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
    lock_fd: Optional[int] = field(default=None, repr=False)
    created: list[Path] = field(default_factory=list, repr=False)

    @property
    def run_name(self) -> str:
        return self.run_dir.name

    def release(self) -> None:
        """End of the run (or of a refused one): remove and unlock ``.run.lock``, then remove the folders
        :func:`take_run_dir` created if the run left them empty. Idempotent."""
        if self.lock_fd is not None:
            (self.run_dir / LOCK_FILE).unlink(missing_ok=True)  # still holding the lock: no other taker races this
            os.close(self.lock_fd)
            self.lock_fd = None
            if os.environ.get(RUN_DIR_ENV) == str(self.run_dir):
                del os.environ[RUN_DIR_ENV]
        for d in self.created:  # deepest first
            try:
                d.rmdir()
            except OSError:  # not empty (the run wrote files) or already gone
                break
        self.created = []


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


def _lock(path: Path) -> Optional[int]:
    """An exclusive lock on ``path/.run.lock`` (created if missing), or ``None`` if a live process holds it."""
    lock = path / LOCK_FILE
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed the file after we opened it: lock the new one


def take_run_dir(runs_dir: str | Path, run_name: str, ckpt_path: Optional[str], overwrite: bool) -> RunPlan:
    """:func:`plan_run`, then take the run folder for this process: create it and hold its lock until
    :meth:`RunPlan.release`. A new run whose folder was taken by a concurrent run in the meantime plans again (it goes
    to the next ``-vN``).

    Raises:
        CLIConfigError: what :func:`plan_run` raises; a resume or ``--overwrite`` of a folder another running run
            holds; ``--runs_dir`` that cannot be written (read-only, a file in the path).
    """
    for _ in range(1000):
        plan = plan_run(runs_dir, run_name, ckpt_path, overwrite)
        keep = plan.resume or plan.clear or ckpt_path == "last"  # continues or replaces what the folder holds
        d = plan.run_dir
        plan.created = [p for p in (d, *d.parents) if not p.exists()]  # deepest first
        try:
            d.mkdir(parents=True, exist_ok=True)
            plan.lock_fd = _lock(d)
        except OSError as e:
            plan.release()
            raise CLIConfigError(f"cannot write the run directory {d} ({e.strerror or type(e).__name__}); "
                                 f"choose a writable --runs_dir") from None
        if plan.lock_fd is not None and (keep or not _holds_files(d)):
            return plan
        plan.release()
        if keep:
            raise CLIConfigError(f"{d} is in use by another running training.fit; wait for it to end or choose "
                                 f"another --run_name")
        # a concurrent run took the folder between plan_run and the lock: plan again (it is in use now)
    raise CLIConfigError(f"no free run directory for {run_name!r} under {runs_dir}")


def place_run(runs_dir: str | Path, run_name: str, ckpt_path: Optional[str], overwrite: bool) -> RunPlan:
    """The run's folder: rank 0 (or a single process) takes it (:func:`take_run_dir`) and publishes it in
    :data:`RUN_DIR_ENV` for the DDP processes it launches; those use that folder and take nothing."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
        plan = take_run_dir(runs_dir, run_name, ckpt_path, overwrite)
        os.environ[RUN_DIR_ENV] = str(plan.run_dir)
        return plan
    plan = plan_run(runs_dir, run_name, ckpt_path, overwrite)
    if os.environ.get(RUN_DIR_ENV):
        plan.run_dir = Path(os.environ[RUN_DIR_ENV])
    return plan


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
