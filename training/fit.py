"""Train a GPT-2 / MLA / MLA+KVSplice model with Lightning: ``python -m training.fit --config NAME``.

``NAME`` (or ``NAME.yaml``) is looked up in ``configs/``; a path works too. Any option can be overridden with a
dotted flag after it: ``--trainer.max_steps 200 --model.kvsplice_ratio 0.3 --data.batch_size 8``. There is no
``fit`` subcommand to type: this entry point always trains.

A run lives in ``<runs_dir>/<run_name>/`` (default ``checkpoints/<config file name>/``):

* ``config.yaml`` — the fully resolved config (re-run it with ``--config checkpoints/<run>/config.yaml``),
* ``last.ckpt`` and ``best-step=...-val_loss=....ckpt`` (lowest validation loss),
* ``metrics.csv`` (CSVLogger) and ``wandb/`` (offline W&B run; ``--wandb.mode online`` to sync live).

``--ckpt_path last`` resumes the run (weights, optimizer, LR schedule, step counters); checkpoints are loaded with
``torch.load(weights_only=True)`` only (see :mod:`training.checkpoint`).

Expected failures (bad config, data unavailable offline, unsafe/corrupt checkpoint) print one ``error: ...`` line to
stderr and exit with status 2.
"""

from __future__ import annotations

import csv
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
EXIT_ERROR = 2

__all__ = ["CONFIG_DIR", "KVSpliceCLI", "WandbSettings", "main", "prepare_args", "resolve_config"]


class CLIConfigError(ValueError):
    """A CLI-level setting is invalid: ``--config`` names no file, a bad ``--run_name``, ``--torch_threads < 1``."""


# ---------------------------------------------------------------------------------------------------- argv handling
def resolve_config(value: str) -> Path:
    """``value`` as a config path: an existing file, else ``configs/<value>`` or ``configs/<value>.yaml``."""
    p = Path(value).expanduser()
    if p.is_file():
        return p
    if p.name == str(value) or not p.is_absolute():  # a bare name (or relative name) -> look in configs/
        for cand in (CONFIG_DIR / value, CONFIG_DIR / f"{value}.yaml"):
            if cand.is_file():
                return cand
    available = ", ".join(sorted(c.stem for c in CONFIG_DIR.glob("*.yaml"))) or "none"
    raise CLIConfigError(f"--config {value!r}: no such file and no {CONFIG_DIR}/{Path(value).stem}.yaml "
                          f"(available: {available})")


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
        path = resolve_config(value)
        if stem is None:
            stem = path.stem
        out += ["--config", str(path)]
    return out, stem


# ---------------------------------------------------------------------------------------------------- CLI pieces
@dataclass
class WandbSettings:
    """Weights & Biases logging. ``offline`` (default) writes the run under ``<run dir>/wandb/`` without an account or
    network (upload later with ``wandb sync <run dir>/wandb/offline-run-*``); ``online`` streams to wandb.ai (run
    ``wandb login`` first); ``disabled`` skips W&B (CSV metrics are still written)."""

    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "kvsplice"
    entity: Optional[str] = None


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


def _csv_logger_class():
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter
    from lightning.pytorch.loggers.logger import rank_zero_experiment

    class _RunWriter(ExperimentWriter):
        """metrics.csv writer for a run directory that also holds checkpoints: a fresh run replaces an old
        metrics.csv (without Lightning's "directory not empty" warning); a resumed run keeps the earlier rows up to
        the step it resumes from and appends after them."""

        def __init__(self, log_dir: str, resume: bool) -> None:
            self._resume = resume
            super().__init__(log_dir)
            self._trim_pending = resume and os.path.isfile(self.metrics_file_path)

        def _check_log_dir_exists(self) -> None:
            if not self._resume and os.path.isfile(self.metrics_file_path):
                os.remove(self.metrics_file_path)

        def save(self) -> None:
            if self._trim_pending and self.metrics:
                first = min(int(m.get("step", 0)) for m in self.metrics)
                with open(self.metrics_file_path, newline="") as f:
                    reader = csv.DictReader(f)
                    keys = list(reader.fieldnames or [])
                    rows = [r for r in reader if not r.get("step") or int(float(r["step"])) < first]
                with open(self.metrics_file_path, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=keys)
                    w.writeheader()
                    w.writerows(rows)
                self.metrics_keys = sorted(keys)
                self._trim_pending = False
            super().save()

    class RunCSVLogger(CSVLogger):
        """CSVLogger writing ``metrics.csv`` / ``hparams.yaml`` straight into the run directory."""

        def __init__(self, save_dir: str, resume: bool = False) -> None:
            super().__init__(save_dir=save_dir, name="", version="")
            self._resume = resume

        @property
        def log_dir(self) -> str:
            return self.save_dir

        @property
        @rank_zero_experiment
        def experiment(self) -> Any:
            if self._experiment is None:
                os.makedirs(self.save_dir, exist_ok=True)
                self._experiment = _RunWriter(self.save_dir, self._resume)
            return self._experiment

    return RunCSVLogger


def _cli_classes():
    """Import Lightning and the project lazily (fast ``--help`` errors, no import cost for argv mistakes)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

    from data import TinyStoriesDataModule
    from models.lit import LitGPT, check_schedule
    from training.checkpoint import safe_checkpoint_io

    class RunConfigSaver(SaveConfigCallback):
        """Writes the resolved config to ``<run dir>/config.yaml`` (rank 0), overwriting a resumed run's."""

        def __init__(self, parser, config, run_dir: str = ".", **kwargs: Any) -> None:
            kwargs.pop("save_to_log_dir", None)
            super().__init__(parser, config, save_to_log_dir=False, **kwargs)
            self.run_dir = run_dir

        def save_config(self, trainer, pl_module, stage) -> None:
            path = Path(self.run_dir) / self.config_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, str(path), overwrite=True, multifile=self.multifile)

    class KVSpliceCLI(LightningCLI):
        """LightningCLI for :class:`models.lit.LitGPT` + :class:`data.TinyStoriesDataModule`, always fitting.

        Adds ``--run_name``, ``--runs_dir``, ``--ckpt_path`` and ``--wandb.*``; links ``data.vocab_size`` →
        ``model.vocab_size`` (at instantiation) and ``model.block_size`` → ``data.block_size``; by default logs to
        W&B (offline) + CSV and checkpoints to ``<runs_dir>/<run_name>/``.
        """

        def __init__(self, args: list[str], default_run_name: Optional[str]) -> None:
            self._default_run_name = default_run_name or "run"
            super().__init__(
                LitGPT,
                TinyStoriesDataModule,
                args=args,
                run=False,
                save_config_callback=RunConfigSaver,
                save_config_kwargs={"overwrite": True},
                seed_everything_default=1337,
                auto_configure_optimizers=False,
                parser_kwargs={
                    "prog": "python -m training.fit",
                    "exit_on_error": False,  # parse errors raise -> main prints one "error: ..." line
                    "description": "Train GPT-2 / MLA / MLA+KVSplice: python -m training.fit --config NAME "
                                   "[--section.option VALUE ...]",
                },
            )

        def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
            self.config = parser.parse_args(args)  # no "args and sys.argv both given" warning: argv is rewritten

        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            parser.add_argument("--run_name", type=Optional[str], default=self._default_run_name,
                                help="run directory name under --runs_dir (default: the config file's name)")
            parser.add_argument("--runs_dir", type=str, default="checkpoints",
                                help="parent folder of run directories (checkpoints, config.yaml, metrics.csv, wandb)")
            parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                                help="resume from 'last' (this run's last.ckpt), 'best' (its best-*.ckpt) or a "
                                     "checkpoint path")
            parser.add_argument("--wandb", type=WandbSettings, default=WandbSettings())
            parser.add_argument("--torch_threads", type=Optional[int], default=None,
                                help="torch.set_num_threads for CPU training (default: PyTorch's choice, one per "
                                     "core); 1 is often faster on a machine busy with other work")
            parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
            parser.link_arguments("model.block_size", "data.block_size")

        # ------------------------------------------------------------------------------------------ run dir
        @property
        def run_name(self) -> str:
            name = self._get(self.config, "run_name") or self._default_run_name
            if not _RUN_NAME.match(name):
                raise CLIConfigError(f"--run_name {name!r}: use letters, digits and . _ - = + (no slashes)")
            return name

        @property
        def run_dir(self) -> Path:
            return Path(self._get(self.config, "runs_dir")) / self.run_name

        def before_instantiate_classes(self) -> None:
            _ = self.run_name  # validate early, before anything is built or written
            check_schedule(int(self._get(self.config, "model").warmup_steps),
                           int(self._get(self.config, "trainer").max_steps))
            threads = self._get(self.config, "torch_threads")
            if threads is not None:
                if threads < 1:
                    raise CLIConfigError(f"--torch_threads must be >= 1, got {threads}")
                import torch

                torch.set_num_threads(threads)

        def _default_loggers(self, run_dir: Path) -> list[Any]:
            resume = self._get(self.config, "ckpt_path") is not None
            loggers: list[Any] = []
            wb: WandbSettings = self._get(self.config_init, "wandb")
            if wb.mode != "disabled":
                os.environ.setdefault("WANDB_SILENT", "true")
                if wb.mode == "offline":
                    os.environ["WANDB_MODE"] = "offline"
                from lightning.pytorch.loggers import WandbLogger

                loggers.append(WandbLogger(name=self.run_name, project=wb.project, entity=wb.entity,
                                           save_dir=str(run_dir), offline=wb.mode == "offline", log_model=False))
            loggers.append(_csv_logger_class()(str(run_dir), resume=resume))
            return loggers

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            run_dir = self.run_dir
            trainer_cfg = self._get(self.config_init, "trainer", default={})
            if trainer_cfg.get("logger") is None:
                kwargs["logger"] = self._default_loggers(run_dir)
            if trainer_cfg.get("default_root_dir") is None:
                kwargs["default_root_dir"] = str(run_dir)
            user_cbs = trainer_cfg.get("callbacks") or []
            user_cbs = user_cbs if isinstance(user_cbs, list) else [user_cbs]
            extra = []
            if not any(isinstance(cb, ModelCheckpoint) for cb in user_cbs):
                extra.append(ModelCheckpoint(dirpath=str(run_dir), filename="best-{step}-{val_loss:.4f}",
                                             monitor="val_loss", mode="min", save_top_k=1, save_last=True))
            self.trainer_defaults["callbacks"] = extra
            self.save_config_kwargs["run_dir"] = str(run_dir)
            trainer = super().instantiate_trainer(**kwargs)
            trainer.strategy.checkpoint_io = safe_checkpoint_io()  # --ckpt_path resumes load with weights_only=True
            return trainer

        # ------------------------------------------------------------------------------------------ fit
        def resolved_ckpt_path(self) -> Optional[str]:
            """``--ckpt_path``: ``best`` → this run's ``best-*.ckpt``; ``last`` and paths are left to Lightning
            (``last`` without a last.ckpt starts from scratch with a warning)."""
            ckpt = self._get(self.config, "ckpt_path")
            if ckpt == "best":
                found = sorted(self.run_dir.glob("best-*.ckpt"), key=lambda p: p.stat().st_mtime)
                if not found:
                    raise CLIConfigError(f"--ckpt_path best: no best-*.ckpt in {self.run_dir}")
                return str(found[-1])
            return ckpt

        def fit(self) -> None:
            check_schedule(int(self.model.hparams.warmup_steps), int(self.trainer.max_steps))
            self.trainer.fit(self.model, datamodule=self.datamodule, ckpt_path=self.resolved_ckpt_path(),
                             weights_only=True)

    return KVSpliceCLI


def __getattr__(name: str) -> Any:  # training.fit.KVSpliceCLI without importing Lightning at module import
    if name == "KVSpliceCLI":
        return _cli_classes()
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------------- main
def _expected_errors() -> tuple[type[BaseException], ...]:
    from jsonargparse import ArgumentError

    from data import DataUnavailableError
    from models.lit import TrainingConfigError
    from training.checkpoint import CheckpointError

    return CLIConfigError, ArgumentError, DataUnavailableError, TrainingConfigError, CheckpointError


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), build everything and train. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, stem = prepare_args(argv)
    except CLIConfigError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
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
    try:
        cli = _cli_classes()(args, default_run_name=stem)
        cli.fit()
    except expected as e:
        hint = " (python -m training.fit --help lists the options)" if type(e).__name__ == "ArgumentError" else ""
        print(f"error: {_one_line(e)}{hint}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
