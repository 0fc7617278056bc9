"""The Lightning side of ``python -m training.fit``: :class:`KVSpliceCLI` (a ``LightningCLI``) and its callbacks.

* :class:`KVSpliceCLI` — :class:`training.lit.LitGPT` + :class:`data.TinyStoriesDataModule`, always fitting; adds
  ``--run_name``, ``--runs_dir``, ``--ckpt_path``, ``--overwrite``, ``--wandb.*`` and ``--torch_threads``; places the run
  with :func:`training.rundir.plan_run` (never into an earlier run's directory); shortens the warmup (and the
  validation interval) of short smoke runs; logs to W&B (offline by default) + ``metrics.csv``; checkpoints
  atomically to the run directory. Its ``model:`` section is flat: :class:`models.GPTConfig`'s fields beside LitGPT's
  training options (old key names read with a note). Without ``--torch_threads`` a CPU run uses the cores other
  processes leave free (:mod:`training.threads`). Ctrl-C is one ``PROG: interrupted`` line and exit status 130
  (:func:`interrupts_end_the_fit`); a run that never took a step leaves no folder it created.
* its callback for the run directory's own files: :class:`training.run_files.RunFiles`.

Lightning is imported at module import; :mod:`training.fit` imports this module only after the argv checks.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, get_type_hints

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from data import TinyStoriesDataModule
from models.compat import OLD_NAMES, old_name_note
from models.config import GPTConfig
from training.config_checks import _SEED_MAX, check_parsed_config, shorten_schedule
from training.lit import LitGPT, check_schedule
from training.checkpoint import CheckpointError, safe_checkpoint_io
from training.loggers import RunCSVLogger
from training.rundir import WANDB_ID_FILE, CLIConfigError, RunPlan, clear_run_files, place_run
from training.run_files import RunFiles
from training.threads import CpuSample, cpu_sample, pick_threads

__all__ = ["KVSpliceCLI", "RunFiles", "WandbSettings", "shorten_schedule"]

def note(message: str) -> None:
    """One ``note: ...`` line on stderr (rank 0 only under DDP)."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
        print(f"note: {message}", file=sys.stderr, flush=True)


@dataclass
class WandbSettings:
    """Weights & Biases logging. ``offline`` (default) writes the run under ``<run dir>/wandb/`` without an account or
    network (upload later with ``wandb sync <run dir>/wandb/offline-run-*``); ``online`` streams to wandb.ai (run
    ``wandb login`` first); ``disabled`` skips W&B (CSV metrics are still written). A resumed run continues the same
    W&B run (its id is kept in ``<run dir>/wandb_id.txt``)."""

    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "kvsplice"
    entity: Optional[str] = None


def _new_wandb_id() -> str:
    """A new W&B run id: 8 random lowercase letters/digits (W&B's own format)."""
    import secrets
    import string

    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def note_old_model_keys(cfg: Any, on_command_line: Callable[[str], bool]) -> None:
    """One note per ``model.<old name>`` given (:data:`models.config.OLD_NAMES`, e.g. ``kvsplice_ratio``). The model
    reads it as the new name; an old name on the command line overrides the config file's new one, otherwise the new
    name wins. Errors name the key as the user gave it. ``on_command_line("--model.X")``: whether argv holds it."""
    model = cfg.get("model") or {}
    for old, new in OLD_NAMES.items():
        value = model.get(old)
        if value is None:
            continue
        if on_command_line(f"--model.{old}") and not on_command_line(f"--model.{new}"):
            model[new] = None  # e.g. --model.kvsplice_ratio 0.3 over a config's kvsplice_keep: 0.1
        if model.get(new) is None:
            note(f"model.{old_name_note(old, value)}")
        elif model[new] != value:
            note(f"model.{old} {value} ignored: model.{new} {model[new]} is given (model.{old} is its old name)")




class FitInterrupted(BaseException):
    """Ctrl-C inside ``trainer.fit`` (raised by :func:`interrupts_end_the_fit`'s handler). Not a
    ``KeyboardInterrupt``, which Lightning answers with its own shutdown lines and ``sys.exit(1)``: Lightning tears
    the run down as for any error and re-raises it; :meth:`KVSpliceCLI.fit` turns it back into ``KeyboardInterrupt``
    (one ``PROG: interrupted`` line, exit status 130)."""


@contextmanager
def interrupts_end_the_fit():
    """While the block runs, SIGINT raises :class:`FitInterrupted` (on the main thread, where Python runs signal
    handlers, when SIGINT has Python's default handler); the previous handler is back afterwards, also after
    Lightning set SIGINT to ``SIG_IGN`` during its shutdown."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def interrupted(signum: int, frame: Any) -> None:
        raise FitInterrupted()

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)




class KVSpliceCLI(LightningCLI):
    """LightningCLI for :class:`training.lit.LitGPT` + :class:`data.TinyStoriesDataModule`, always fitting.

    Adds ``--run_name``, ``--runs_dir``, ``--ckpt_path``, ``--overwrite``, ``--torch_threads`` and ``--wandb.*``; links
    ``data.vocab_size`` → ``model.vocab_size`` (at instantiation) and ``model.block_size`` → ``data.block_size``; by
    default logs to W&B (offline) + CSV and checkpoints to the run directory.

    Args:
        args: the command line (``--config`` already resolved to paths, see :func:`training.fit.prepare_args`).
        default_run_name: run name when ``--run_name`` is not given (the config file's name).
        cpu_start: a :func:`training.threads.cpu_sample` taken when the program started (default: now); the free
            cores since then choose the thread count when ``--torch_threads`` is not given.
    """

    def __init__(self, args: list[str], default_run_name: Optional[str],
                 cpu_start: Optional[CpuSample] = None) -> None:
        self._cpu_start = cpu_start if cpu_start is not None else cpu_sample()
        self._default_run_name = default_run_name or "run"
        self._args = list(args)
        self.plan: Optional[RunPlan] = None
        self._notes: list[str] = []
        self.wandb_id: Optional[str] = None
        try:
            super().__init__(
                LitGPT,
                TinyStoriesDataModule,
                args=args,
                run=False,
                save_config_callback=RunFiles,
                seed_everything_default=1337,
                auto_configure_optimizers=False,
                parser_kwargs={
                    "prog": "python -m training.fit",
                    "exit_on_error": False,  # parse errors raise -> main prints one "PROG: error: ..." line
                    "description": "Train GPT-2 / MLA / MLA+KVSplice: python -m training.fit --config NAME "
                                   "[--section.option VALUE ...]",
                },
            )
        except BaseException:
            self.release()  # a run refused while being built leaves no folder or lock behind
            raise

    def release(self) -> None:
        """Give the run folder back at the end of the run (:meth:`training.rundir.RunPlan.release`; the entry point
        calls it). A run that never took a training step (refused, or interrupted before its first step) leaves no
        folder it created: what it wrote there (W&B's files, the config) is removed first."""
        if self.plan is None:
            return
        if self.plan.created and not self.took_a_step():
            clear_run_files(self.plan.run_dir)
        self.plan.release()

    def took_a_step(self) -> bool:
        """Whether this run trained at least one optimizer step."""
        trainer = getattr(self, "trainer", None)
        files = [cb for cb in (trainer.callbacks if trainer is not None else []) if isinstance(cb, RunFiles)]
        return bool(files) and files[0].start_step is not None and trainer.global_step > files[0].start_step

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Lightning's trainer / model / data sections; the model's is flat: :class:`models.GPTConfig`'s fields beside
        LitGPT's training options (``--model.n_layer``, ``--model.learning_rate``), as the configs write it."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_class_arguments(LitGPT, "model", fail_untyped=False, instantiate=True, sub_configs=True)
        for old, new in OLD_NAMES.items():  # a config's old key (models.compat): LitGPT reads it as the new one
            parser.add_argument(f"--model.{old}", type=get_type_hints(GPTConfig)[new], default=None,
                                help=f"the old name of --model.{new}")
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.config = parser.parse_args(args)  # no "args and sys.argv both given" warning: argv is rewritten
        check_parsed_config(self.config, self._given)  # refusals first: before Lightning seeds, prints or builds
        note_old_model_keys(self.config, self._given)

    def _set_seed(self) -> None:
        """Lightning's seeding without its ``Seed set to N`` line (a refusal after it would not be the first line).
        ``--seed_everything true`` draws a random seed (Lightning's own default there is 0) and says which in a note
        (config.yaml records it); DDP ranks inherit it through ``PL_GLOBAL_SEED``."""
        from lightning.fabric.utilities.seed import seed_everything

        seed = self._get(self.config, "seed_everything")
        if seed is False:
            return
        drawn = seed is True
        if drawn:
            import secrets

            seed = int(os.environ.get("PL_GLOBAL_SEED") or secrets.randbelow(_SEED_MAX + 1))
            note(f"seed_everything: {seed}")
        self.config["seed_everything"] = seed_everything(seed, workers=True, verbose=False)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_name", type=Optional[str], default=self._default_run_name,
                            help="run directory name under --runs_dir (default: the config file's name); if it holds "
                                 "an earlier run, a new run goes to NAME-v1, NAME-v2, ...")
        parser.add_argument("--runs_dir", type=str, default="checkpoints",
                            help="parent folder of run directories (checkpoints, config.yaml, metrics.csv, wandb)")
        parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                            help="resume from 'last' (this run's last.ckpt), 'best' (its best-*.ckpt) or a "
                                 "checkpoint path; the run directory is continued (its config.yaml is kept)")
        parser.add_argument("--overwrite", type=bool, nargs="?", const=True, default=False,
                            help="replace the earlier run in the run directory instead of starting NAME-vN "
                                 "(--overwrite or --overwrite true)")
        parser.add_argument("--wandb", type=WandbSettings, default=WandbSettings())
        parser.add_argument("--torch_threads", type=Optional[int], default=None,
                            help="torch.set_num_threads for CPU training (default: one thread per core that other "
                                 "processes left free at start, at most PyTorch's own choice of one per core; see "
                                 "training.threads); 1 is often faster on a machine busy with other work")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("model.block_size", "data.block_size")

    # ------------------------------------------------------------------------------------------ checks
    def _given(self, option: str) -> bool:
        """Whether ``option`` (e.g. ``--model.warmup_steps``) is on the command line itself."""
        return any(a == option or a.startswith(option + "=") for a in self._args)

    def before_instantiate_classes(self) -> None:
        """Validate the CLI options and place the run before anything is built or written."""
        cfg = self.config
        run_name = self._get(cfg, "run_name") or self._default_run_name
        self.plan = place_run(self._get(cfg, "runs_dir"), run_name, self._get(cfg, "ckpt_path"),
                              bool(self._get(cfg, "overwrite")))
        threads = self._get(cfg, "torch_threads")  # checked by check_parsed_config
        model, trainer = self._get(cfg, "model"), self._get(cfg, "trainer")
        max_steps = trainer.max_steps
        warmup, msg = shorten_schedule(int(model.warmup_steps), max_steps,
                                       self._given("--model.warmup_steps"))
        if msg:
            model.warmup_steps = warmup
        check_schedule(int(model.warmup_steps), int(max_steps))
        notes = list(self.plan.notes) + ([msg] if msg else [])
        interval, accumulate = trainer.val_check_interval, trainer.accumulate_grad_batches or 1
        if (isinstance(interval, int) and not isinstance(interval, bool) and trainer.check_val_every_n_epoch is None
                and interval > max_steps * accumulate and not self._given("--trainer.val_check_interval")):
            trainer.val_check_interval = max_steps * accumulate
            notes.append(f"trainer.val_check_interval {interval} is beyond this run's {max_steps * accumulate} "
                         f"training batches: validating (and checkpointing) at its end instead")
        import torch

        accelerator = str(trainer.accelerator or "auto")
        if threads is None and (accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())):
            picked, msg = pick_threads(self._cpu_start, torch.get_num_threads())
            threads = picked if msg else None  # None: torch's own count stands
            notes += [msg] if msg else []
        self._notes = notes  # printed once the trainer is built: its refusals come first
        if threads is not None:
            torch.set_num_threads(threads)

    # ------------------------------------------------------------------------------------------ trainer
    def _default_loggers(self, run_dir: Path) -> list[Any]:
        loggers: list[Any] = []
        wb: WandbSettings = self._get(self.config_init, "wandb")
        if wb.mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            if wb.mode == "offline":
                os.environ["WANDB_MODE"] = "offline"
            from lightning.pytorch.loggers import WandbLogger

            assert self.plan is not None
            id_file = run_dir / WANDB_ID_FILE
            stored = id_file.read_text().strip() if self.plan.resume and id_file.is_file() else ""
            self.wandb_id = stored or _new_wandb_id()
            loggers.append(WandbLogger(name=self.plan.run_name, project=wb.project, entity=wb.entity,
                                       save_dir=str(run_dir), offline=wb.mode == "offline", log_model=False,
                                       id=self.wandb_id, resume="allow"))
        loggers.append(RunCSVLogger(str(run_dir)))
        return loggers

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        assert self.plan is not None
        run_dir = self.plan.run_dir
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
        self.save_config_kwargs.update(plan=self.plan, wandb_id=self.wandb_id)
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as e:  # Lightning's checks of --trainer.* values
            raise CLIConfigError(f"trainer: {e}") from None
        trainer.strategy.checkpoint_io = safe_checkpoint_io()  # loads with weights_only=True, saves atomically
        for line in self._notes:
            note(line)
        return trainer

    # ------------------------------------------------------------------------------------------ fit
    def fit(self) -> None:
        assert self.plan is not None
        check_schedule(int(self.model.hparams.warmup_steps), int(self.trainer.max_steps))
        try:
            with interrupts_end_the_fit():
                self.trainer.fit(self.model, datamodule=self.datamodule, ckpt_path=self.plan.ckpt_path,
                                 weights_only=True)
        except FitInterrupted:
            raise KeyboardInterrupt from None
        except SystemExit:  # Lightning's answer to a KeyboardInterrupt raised inside the run (not by Ctrl-C)
            if self.trainer.interrupted:
                raise KeyboardInterrupt from None
            raise
        except CheckpointError as e:  # LitGPT.on_load_checkpoint's refusals do not know the file: name it
            if str(e).startswith("cannot resume") and self.plan.ckpt_path:
                raise CheckpointError(f"--ckpt_path {self.plan.ckpt_path}: {e}") from None
            raise
        finally:  # close this run's W&B run, so a later run in the same process starts its own
            for logger in self.trainer.loggers:
                if type(logger).__name__ == "WandbLogger" and getattr(logger, "_experiment", None) is not None:
                    import wandb

                    wandb.finish(exit_code=0 if self.trainer.state.status == "finished" else 1)
