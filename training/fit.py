"""Train a GPT-2 / MLA / MLA+KVSplice model with Lightning: ``python -m training.fit --config NAME``.

``NAME`` (or ``NAME.yaml``) is looked up in the project's ``configs/`` folder (found from the package, whatever the
current directory: :func:`models.config.config_path`); a path works too. Any option can be overridden with a dotted
flag after it: ``--trainer.max_steps 200 --model.kvsplice_keep 0.3 --data.batch_size 8``. There is no ``fit``
subcommand to type: this entry point always trains.

A run lives in ``<runs_dir>/<run_name>/`` (default ``checkpoints/<config file name>/``):

* ``config.yaml`` — the fully resolved config (re-run it with ``--config checkpoints/<run>/config.yaml``),
* ``last.ckpt`` and ``best-step=...-val_loss=....ckpt`` (lowest validation loss), written atomically,
* ``metrics.csv`` (CSVLogger) and ``wandb/`` (offline W&B run; ``--wandb.mode online`` to sync live).

Re-using a run name never destroys the earlier run: a new run goes to ``<run_name>-v1`` (``-v2``, ...) and says so,
unless ``--overwrite`` is given. ``--ckpt_path last`` resumes the run in its directory (weights, optimizer, LR schedule,
step counters and the exact position in the training data: an interrupted and resumed run trains on the same batches
as an uninterrupted one); checkpoints are loaded with ``torch.load(weights_only=True)`` only (see
:mod:`training.checkpoint`). Details: :mod:`training.rundir`.

A run shorter than the configured warmup (``--trainer.max_steps 200`` on a 500-step warmup) gets a warmup of 10 % of
``max_steps`` with a note, unless ``--model.warmup_steps`` is given.

Expected failures (bad option or config, data unavailable offline or not text, unsafe/corrupt/non-finite checkpoint)
print one ``python -m training.fit: error: ...`` line to stderr and exit with status 2
(:func:`kvsplice.io.cli.run_cli`).

The Lightning pieces live in :mod:`training.lightning_cli`; this module only resolves ``--config`` and maps errors to exit codes.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice train"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

from training.threads import cpu_sample

CPU_AT_START = cpu_sample()  # the free cores over the start-up choose the thread count (training.threads)

import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from kvsplice.io.cli import EXIT_USAGE, UsageError, run_cli
from models.config import CONFIG_DIR, ConfigNotFoundError, config_path
from training.rundir import CLIConfigError

EXIT_ERROR = EXIT_USAGE

__all__ = ["CONFIG_DIR", "CLIConfigError", "main", "prepare_args", "config_file"]


def config_file(value: str) -> Path:
    """``value`` as a config path: an existing file, else ``configs/<value>`` or ``configs/<value>.yaml`` in the
    package's config folder (not the current directory)."""
    try:
        return config_path(value)
    except ConfigNotFoundError as e:
        raise CLIConfigError(f"--{e}") from None


def check_config_file(path: Path) -> Path:
    """A ``--config`` file must be a UTF-8 YAML mapping read by the one safe reader (:mod:`models.safe_yaml`: a
    small regular file, few aliases, no key twice) — one clear error instead of a decoder traceback or a hang."""
    import yaml

    from models.safe_yaml import YamlRefused, load_yaml_file

    try:
        data = load_yaml_file(path)
    except YamlRefused as e:
        raise CLIConfigError(f"--config {e}") from None
    except UnicodeDecodeError:
        raise CLIConfigError(f"--config {path}: not a text (UTF-8 YAML) file") from None
    except yaml.YAMLError as e:
        raise CLIConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise CLIConfigError(f"--config {path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a YAML {type(data).__name__}"
        raise CLIConfigError(f"--config {path}: {what}, expected a mapping of sections (trainer:, model:, data:)")
    return path


def prepare_args(argv: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """Rewrite every ``--config NAME`` / ``--config=NAME`` / ``-c NAME`` to a real path.

    Returns ``(args, stem)`` where ``stem`` is the first config's file name without extension (the default run
    name), or ``None`` without a config. A leading ``fit`` (LightningCLI habit) is dropped.
    """
    args = list(argv)
    if args and args[0] == "fit":
        args = args[1:]
    out: list[str] = []
    stem: Optional[str] = None
    i = 0
    while i < len(args):
        a = args[i]
        value: Optional[str] = None
        if a in ("--config", "-c"):
            if i + 1 >= len(args):
                raise CLIConfigError(f"{a} needs a value: a config name from configs/ or a path")
            value, i = args[i + 1], i + 2
        elif a.startswith("--config="):
            value, i = a.split("=", 1)[1], i + 1
        else:
            out.append(a)
            i += 1
            continue
        path = check_config_file(config_file(value))
        if stem is None:
            stem = path.stem
        out += ["--config", str(path)]
    return out, stem


def __getattr__(name: str) -> Any:  # training.fit.KVSpliceCLI etc. without importing Lightning at module import
    if name in ("KVSpliceCLI", "RunFiles", "WandbSettings"):
        from training import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(name)


def _expected_errors() -> tuple[type[BaseException], ...]:
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from data.errors import DataConfigError, DataUnavailableError
    from training.lit import TrainingConfigError
    from training.checkpoint import CheckpointError

    return (CLIConfigError, ArgumentError, DataUnavailableError, DataConfigError, TrainingConfigError,
            CheckpointError, ConfigNotFoundError, MisconfigurationException)


def safe_jsonargparse_yaml() -> None:
    """Every YAML jsonargparse parses — config files given to any option, option values — goes through the safe
    reader's checks first (:func:`models.safe_yaml.check_yaml`: few aliases, no key twice); a refused one is a parse
    error of that file or value."""
    import yaml
    from jsonargparse import get_loader, set_loader

    from models.safe_yaml import YamlRefused, check_yaml

    base = get_loader("yaml")
    if getattr(base, "checked_by_safe_yaml", False):
        return

    def load(text: str) -> Any:
        check_yaml(text)
        return base(text)

    load.checked_by_safe_yaml = True  # type: ignore[attr-defined]
    set_loader("yaml", load, (yaml.YAMLError, YamlRefused))


def _last_value(args: Sequence[str], option: str) -> Optional[str]:
    """The value of the last ``OPTION VALUE`` / ``OPTION=VALUE`` in ``args`` (the one jsonargparse keeps)."""
    value = None
    for i, a in enumerate(args):
        if a == option and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(option + "="):
            value = a.split("=", 1)[1]
    return value


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), build everything and train. Returns the exit status: 0, or
    :data:`EXIT_ERROR` after one ``python -m training.fit: error: ...`` line on stderr."""
    return run_cli(PROG, lambda: _main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    argv_is_sys = argv is None  # the program's own run: measured since its import, not since a test's
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, stem = prepare_args(argv)
    except CLIConfigError as e:
        raise UsageError(_one_line(e)) from None
    import warnings

    import torch

    for pattern in (r"Checkpoint directory .* exists and is not empty",  # expected: the run dir holds logs too
                    r".*isinstance\(treespec, LeafSpec\)",  # Lightning internals vs torch 2.13
                    r".*litlogger"):
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("WANDB_SILENT", "true")
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 parts of mixed precision
    expected = _expected_errors()
    from training.checkpoint import CheckpointError, check_resume_file

    try:  # a refused checkpoint is the first line, before Lightning's start-up lines
        check_resume_file(_last_value(args, "--ckpt_path"), "--ckpt_path")
    except CheckpointError as e:
        raise UsageError(_one_line(e)) from None
    cli = None
    try:
        from training.lightning_cli import KVSpliceCLI

        safe_jsonargparse_yaml()
        cli = KVSpliceCLI(args, default_run_name=stem, cpu_start=CPU_AT_START if argv_is_sys else None)  # takes the run folder (released by itself if refused)
        cli.fit()
    except expected as e:  # one line (messages of jsonargparse/Lightning run over several)
        hint = f" ({PROG} --help lists the options)" if type(e).__name__ == "ArgumentError" else ""
        raise UsageError(f"{_one_line(e)}{hint}") from None
    finally:
        if cli is not None:
            cli.release()  # the run folder's lock; the folder too if this run wrote nothing into it
    return 0


if __name__ == "__main__":
    sys.exit(main())
