"""The checks of ``kvsplice train``'s parsed config, run before Lightning seeds, prints or builds anything: a bad
``--model.*`` / ``--data.*`` / ``--trainer.*`` value, a run that cannot fit in memory or a pickled checkpoint named
by ``ckpt_path`` or ``model.init_from`` (on the command line or in a ``--config`` file) is the command's first and
only line (one :class:`~training.rundir.CLIConfigError`, :class:`~training.lit.TrainingConfigError`,
:class:`~data.errors.DataConfigError` or :class:`~training.checkpoint.CheckpointError`).

The classes check the same values again when they are built; these checks only move the refusal up front.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Callable, Optional

from data.settings import check_settings
from kvsplice.core.limits import check_threads, check_training_fits
from models.compat import OLD_NAMES, rename_old_keys
from models.config import TRAINING_KEYS, GPTConfig
from training.checkpoint import CheckpointError, check_resume_file
from training.lit import TrainingConfigError, check_schedule, check_training_options
from training.rundir import CLIConfigError

__all__ = ["check_parsed_config", "check_values", "shorten_schedule", "training_device"]

_SEED_MAX = 2**32 - 1
_COUNT_MAX = 1 << 30
"""The most steps / batches a trainer count takes (more is a typo; Lightning overflows on 1e23)."""
_DATA_SETTINGS = tuple(inspect.signature(check_settings).parameters)


def shorten_schedule(warmup_steps: int, max_steps: int, warmup_explicit: bool) -> tuple[int, Optional[str]]:
    """``(warmup_steps, note)`` for a run of ``max_steps``: a configured warmup that does not fit a shortened run
    (``warmup_steps >= max_steps``) becomes 10 % of ``max_steps`` with a note, unless the user set it explicitly
    (then :func:`training.lit.check_schedule` reports the conflict)."""
    if warmup_explicit or max_steps is None or max_steps < 1 or warmup_steps < max_steps:
        return warmup_steps, None
    new = max_steps // 10
    return new, (f"model.warmup_steps {warmup_steps} does not fit trainer.max_steps {max_steps}: using "
                 f"warmup_steps {new} (10% of max_steps); set --model.warmup_steps to choose")


def training_device(accelerator: Any) -> Optional[str]:
    """``"cuda"`` when the run trains on a GPU (the memory its sizes must fit), else ``None`` (this machine's RAM)."""
    import torch

    return "cuda" if str(accelerator or "auto") in ("auto", "gpu", "cuda") and torch.cuda.is_available() else None


def check_values(cfg: Any) -> None:
    """Option values the types alone do not exclude and Lightning would only trip over later (a ZeroDivisionError,
    gradients flipped by a negative clip value, numpy's seed bounds). Raises :class:`CLIConfigError`."""
    seed = cfg.get("seed_everything")
    if not isinstance(seed, bool) and seed is not None and not 0 <= int(seed) <= _SEED_MAX:
        raise CLIConfigError(f"--seed_everything must be true, false or an integer in [0, {_SEED_MAX}], got {seed}")
    t = cfg.get("trainer")
    if t is None:
        return

    def bad(option: str, value: Any, allowed: str) -> CLIConfigError:
        return CLIConfigError(f"--trainer.{option} must be {allowed}, got {value!r}")

    v = t.get("val_check_interval")
    interval = "an integer number of batches in [1, 2^30], a fraction of an epoch in (0, 1] or a time 'DD:HH:MM:SS'"
    if isinstance(v, str) and not re.fullmatch(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", v):
        raise bad("val_check_interval", v, interval)
    if v is not None and not isinstance(v, (bool, str, dict)) and isinstance(v, (int, float)) and not (
            (isinstance(v, int) and 1 <= v <= _COUNT_MAX) or (isinstance(v, float) and 0 < v <= 1)):
        raise bad("val_check_interval", v, interval)
    v = t.get("accumulate_grad_batches")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _COUNT_MAX):
        raise bad("accumulate_grad_batches", v, "an integer in [1, 2^30]")
    v = t.get("max_steps")
    if v is not None and not isinstance(v, bool) and isinstance(v, int) and v > _COUNT_MAX:
        raise bad("max_steps", v, "-1 (no limit) or at most 2^30 (more steps than any run takes)")
    v = t.get("check_val_every_n_epoch")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise bad("check_val_every_n_epoch", v, "null or an integer >= 1")
    v = t.get("gradient_clip_val")
    if v is not None and not 0 <= v <= 1e6:
        raise bad("gradient_clip_val", v, "null or a number in [0, 1e6] (0 disables clipping; a language model's "
                  "gradient norm is ~1, a larger bound never clips)")
    v = t.get("log_every_n_steps")
    if v is not None and not 0 <= v <= _COUNT_MAX:
        raise bad("log_every_n_steps", v, "an integer in [0, 2^30]")


def _model_config(model: dict) -> GPTConfig:
    """The :class:`GPTConfig` the ``model:`` section describes (an old key name is read as its new one and named
    in the error; the vocabulary, which the data sets later, at its default)."""
    given = {k: v for k, v in model.items() if k not in TRAINING_KEYS}
    try:
        with warnings.catch_warnings():  # an old name is read with a note later (note_old_model_keys)
            warnings.simplefilter("ignore", DeprecationWarning)
            return GPTConfig(**rename_old_keys(given, "model", new_wins=True))
    except (TypeError, ValueError) as e:  # "GPTConfig.kvsplice_keep must be ..." -> the option as the user gave it
        msg = str(e).replace("GPTConfig.", "model.", 1)
        for old, new in OLD_NAMES.items():
            if given.get(old) is not None and given.get(new) is None:
                msg = msg.replace(f"model.{new}", f"model.{old}")
        raise TrainingConfigError(msg) from None


def _checkpoint_option(cfg: Any, key: str, option: str, given: Callable[[str], bool]) -> None:
    """A checkpoint named by ``key`` loads with ``weights_only=True``; the error names ``option`` as the user gave
    it (on the command line or in a ``--config`` file)."""
    value = cfg.get(key)
    where = option if given(option) else f"{key} (in the --config file)"
    if value is not None and not isinstance(value, str):
        raise CLIConfigError(f"{where} must be a path, 'last' or 'best', got {value!r}")
    try:
        check_resume_file(value, where)
    except CheckpointError as e:
        raise CheckpointError(str(e)) from None


def check_parsed_config(cfg: Any, given: Callable[[str], bool]) -> None:
    """Every check of the parsed config that needs nothing built: trainer values, the model's fields and training
    options, the data settings, the warmup schedule, the memory a step needs, the thread count and the checkpoints
    named. ``given("--model.X")``: whether the command line itself holds the option."""
    check_values(cfg)
    model = cfg.get("model")
    data = cfg.get("data")
    trainer = cfg.get("trainer")
    if model is None or data is None or trainer is None:
        return
    model_d, data_d = dict(model.items()), dict(data.items())
    _model_config(model_d)
    check_training_options(**{k: model_d[k] for k in TRAINING_KEYS if k in model_d})
    check_settings(**{k: data_d.get(k) for k in _DATA_SETTINGS})
    max_steps = trainer.get("max_steps")
    warmup, _ = shorten_schedule(int(model_d.get("warmup_steps", 0)), max_steps, given("--model.warmup_steps"))
    check_schedule(warmup, max_steps)
    check_training_fits(model, data_d["batch_size"], training_device(trainer.get("accelerator")))  # vocab: unknown yet
    threads = cfg.get("torch_threads")
    if threads is not None and threads < 1:
        raise CLIConfigError(f"--torch_threads must be >= 1, got {threads}")
    check_threads("--torch_threads", threads)  # within the CPUs: 100000 threads crash torch
    _checkpoint_option(cfg, "ckpt_path", "--ckpt_path", given)
    _checkpoint_option(cfg, "model.init_from", "--model.init_from", given)
