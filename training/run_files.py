"""The run directory's own files, written by :class:`RunFiles` (a ``SaveConfigCallback`` of
:class:`training.lightning_cli.KVSpliceCLI`): it removes stale temporary files (and, with ``--overwrite``, the earlier
run's files) when training is about to start, writes ``config.yaml`` / ``wandb_id.txt`` when it starts (never for a
resume that fails), trims ``metrics.csv`` to the resumed step and flushes it at every checkpoint."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import yaml
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback

from models.compat import OLD_NAMES
from models.safe_yaml import load_yaml_file
from training.checkpoint import remove_stale_temp_files
from training.loggers import RunCSVLogger
from training.rundir import WANDB_ID_FILE, RunPlan, clear_run_files

__all__ = ["RunFiles", "without_old_model_keys"]

#: Keys of the CLI's own options that never go into a saved config (re-running a config is a new run).
_NOT_SAVED = {"ckpt_path": None, "overwrite": False}
_BEST_STEP = re.compile(r"^best-step=(\d+)")


def without_old_model_keys(cfg: Any) -> Any:
    """``cfg`` (a copy) with ``model.<old name>`` moved to the new name: what a saved config holds."""
    cfg = cfg.clone()
    model = cfg.get("model")
    for old, new in OLD_NAMES.items():
        if model is not None and old in model:
            value = model.pop(old)
            if model.get(new) is None:
                model[new] = value
    return cfg


class RunFiles(SaveConfigCallback):
    """Writes the run directory's own files at the right moments (rank 0). See the module docstring.

    Args:
        parser, config: from LightningCLI (the resolved config, saved as ``config.yaml``).
        plan: where and how this run writes (:func:`training.rundir.plan_run`).
        wandb_id: the W&B run id to record (``None`` without W&B).
    """

    def __init__(self, parser: LightningArgumentParser, config: Any, plan: Optional[RunPlan] = None,
                 wandb_id: Optional[str] = None, **kwargs: Any) -> None:
        kwargs.pop("save_to_log_dir", None)
        kwargs.pop("overwrite", None)
        super().__init__(parser, config, save_to_log_dir=False, overwrite=True, **kwargs)
        self.plan = plan if plan is not None else RunPlan(Path("."))
        self.wandb_id = wandb_id
        self.start_step: Optional[int] = None
        """The step training started from (after any checkpoint loaded); ``None`` until training starts."""

    # --------------------------------------------------------------------------------------------- helpers
    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir

    def _config_to_save(self) -> Any:
        cfg = without_old_model_keys(self.config)
        for key, value in _NOT_SAVED.items():
            if key in cfg:
                cfg[key] = value
        cfg["run_name"] = self.plan.run_name
        return cfg

    def _write_config(self, path: Path, cfg: Any) -> None:
        from models.checkpoint import atomic_write

        atomic_write(path, lambda tmp: self.parser.save(cfg, str(tmp), overwrite=True, multifile=False))

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Unused: the config is written by :meth:`on_train_start`, once any checkpoint has loaded."""

    # --------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Data and model are built and checked: prepare the directory (nothing of the new run is written yet)."""
        if stage != "fit" or not trainer.is_global_zero:
            return
        if self.plan.clear:
            clear_run_files(self.run_dir)
        remove_stale_temp_files(self.run_dir)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Any checkpoint has loaded: write the config and W&B id, trim ``metrics.csv`` to the resumed step."""
        step = int(trainer.global_step)
        self.start_step = step
        for logger in trainer.loggers:
            if isinstance(logger, RunCSVLogger):
                logger.resume_at(step)
        if not trainer.is_global_zero:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = self._config_to_save()
        saved = self.run_dir / self.config_filename
        if not self.plan.resume or not saved.is_file():
            self._write_config(saved, cfg)
        else:  # keep the run's config; record changed options of this resume next to it
            old = load_yaml_file(saved) or {}  # the run folder's file: read as any YAML a user gives
            new = yaml.safe_load(self.parser.dump(cfg)) or {}
            if {k: v for k, v in old.items() if k != "run_name"} != {k: v for k, v in new.items() if k != "run_name"}:
                self._write_config(self.run_dir / f"config.resume-{step}.yaml", cfg)
        if self.wandb_id is not None:
            id_file = self.run_dir / WANDB_ID_FILE
            if not id_file.is_file() or id_file.read_text().strip() != self.wandb_id:
                id_file.write_text(self.wandb_id + "\n")
        if self.plan.resume:  # best checkpoints a killed run saved after the one resumed from are stale
            for f in self.run_dir.glob("best-*.ckpt"):
                m = _BEST_STEP.match(f.name)
                if m and int(m.group(1)) > step:
                    f.unlink(missing_ok=True)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Rows logged up to this checkpoint reach ``metrics.csv`` before the checkpoint file does."""
        for logger in trainer.loggers:
            if isinstance(logger, RunCSVLogger):
                logger.save()
