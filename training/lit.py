"""LitGPT: the Lightning training wrapper around :class:`models.GPT`.

``LitGPT(**config.to_dict(), learning_rate=...)`` takes :class:`models.GPTConfig`'s fields flat beside the
optimiser's options, one form everywhere: a config file's ``model:`` section and the command line give them so
(``--model.kvsplice_keep 0.3``, ``--model.learning_rate 3e-4``), and checkpoints store them so, as primitives (they
load with ``torch.load(..., weights_only=True)``).

* loss: next-token cross-entropy (fp32 logits).
* optimiser: AdamW; weight decay on 2-D weights (incl. embeddings, like nanoGPT), none on biases, norms and
  KVSplice's orthogonally parametrised matrices.
* schedule: linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio * learning_rate`` at the
  trainer's ``max_steps`` (optimizer steps).
* logged: ``train_loss`` and ``tokens_per_sec`` (smoothed; both in the progress bar), ``lr``, ``tokens`` (seen so far, all
  devices), ``train_time_s`` (wall time of training steps, validation excluded), ``val_loss`` (mean loss over every
  validation token) and ``val_ppl = exp(val_loss)``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from kvsplice.core.limits import MAX_LEARNING_RATE
from models.compat import OLD_NAMES, rename_old_keys
from models.config import GPTConfig
from models.gpt import GPT

__all__ = ["LitGPT", "TrainingConfigError", "check_schedule", "check_training_options", "lr_factor", "param_groups"]


class TrainingConfigError(ValueError):
    """A training setting is invalid (e.g. ``warmup_steps >= max_steps``); the message names the option."""


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` for ``step < warmup_steps``, then cosine decay from 1 to
    ``min_lr_ratio`` reached at ``max_steps`` (and kept after it).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float,
                 splice_lr: Optional[float] = None) -> list[dict[str, Any]]:
    """AdamW groups: ``decay`` = 2-D weights (linear, embeddings); ``no_decay`` = biases, norms and parametrised
    (orthogonal) KVSplice matrices, whose decay would fight the constraint. With ``splice_lr``, KVSplice's
    compress/expand matrices form their own groups (``splice_decay`` / ``splice_no_decay``) at that learning rate."""
    groups: dict[str, list] = {"decay": [], "no_decay": [], "splice_decay": [], "splice_no_decay": []}
    for name, p in model.named_parameters():  # tied lm_head/wte appears once
        if not p.requires_grad:
            continue
        kind = "decay" if p.dim() >= 2 and ".parametrizations." not in name else "no_decay"
        if splice_lr is not None and ".splice." in name:
            kind = "splice_" + kind
        groups[kind].append(p)
    out = [{"params": groups["decay"], "weight_decay": weight_decay, "name": "decay"},
           {"params": groups["no_decay"], "weight_decay": 0.0, "name": "no_decay"}]
    for kind, wd in (("splice_decay", weight_decay), ("splice_no_decay", 0.0)):
        if groups[kind]:
            out.append({"params": groups[kind], "weight_decay": wd, "lr": splice_lr, "name": kind})
    return out


class LitGPT(L.LightningModule):
    """GPT-2 / MLA / MLA+KVSplice language model for Lightning.

    Args:
        vocab_multiple: round ``vocab_size`` up to a multiple of this (64 gives GPT-2's 50304: faster matmuls);
            the extra logits are never targets and learn to stay low.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay of the 2-D weights.
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup optimizer steps; must be < ``trainer.max_steps``.
        min_lr_ratio: the cosine decays to ``min_lr_ratio * learning_rate`` at ``trainer.max_steps``.
        init_from: a checkpoint (``training.fit`` or ``kvsplice to-mla``) whose weights start the run:
            fine-tuning with a fresh optimizer, schedule and step count (unlike ``--ckpt_path``, which resumes). Its
            model must have this config's architecture (the error lists the fields that differ).
        optimizer_impl: AdamW's implementation: ``fused`` (one kernel for all parameters), ``foreach`` (grouped
            kernels), or ``auto`` (fused on CUDA, foreach elsewhere). Gradient clipping works with each: Lightning's
            mixed-precision plugin refuses to clip for an optimizer that unscales inside its step (fused AdamW), so
            :meth:`configure_gradient_clipping` unscales (fp16) and clips itself.
        compile: ``torch.compile`` the model (in place: parameter names and checkpoints are unchanged); the first
            steps of training and of validation pay the compilation.
        splice_lr_mult: learning-rate multiplier of KVSplice's compress/expand matrices (1: the model's).
        config_fields: the model, :class:`models.GPTConfig`'s fields (a config file's ``model:`` section, the command
            line's ``--model.FIELD``, a checkpoint's hyper-parameters; with the CLI, ``vocab_size`` comes from the
            data module's tokenizer); a key under its old name (:mod:`models.compat`) is read as the new one, which
            wins when both are set.

    Checkpoints store the hyper-parameters flat (the config's fields, then the options above; only primitives, so
    they load with ``torch.load(..., weights_only=True)``) and ``LitGPT(**hparams)`` rebuilds the module.
    """

    def __init__(
        self,
        *,
        vocab_multiple: int = 1,
        learning_rate: float = 6e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 1000,
        min_lr_ratio: float = 0.1,
        init_from: Optional[str] = None,
        optimizer_impl: Literal["auto", "fused", "foreach"] = "auto",
        compile: bool = False,
        splice_lr_mult: float = 1.0,
        **config_fields: Any,
    ) -> None:
        super().__init__()
        given_old = {old: new for old, new in OLD_NAMES.items()  # errors name the key the user gave
                     if config_fields.get(old) is not None and config_fields.get(new) is None}
        config_fields = rename_old_keys(config_fields, "model", new_wins=True)  # the training command noted each
        try:  # jsonargparse reads GPTConfig's fields for --model.FIELD from this call
            config = GPTConfig(**config_fields)
        except ValueError as e:  # "GPTConfig.kvsplice_keep must be ..." -> name the CLI option
            message = str(e).replace("GPTConfig.", "model.", 1)
            for old, new in given_old.items():
                message = message.replace(f"model.{new} ", f"model.{old} ")
            raise TrainingConfigError(message) from None
        training = dict(vocab_multiple=vocab_multiple, learning_rate=learning_rate, weight_decay=weight_decay,
                        betas=betas, eps=eps, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
                        init_from=init_from, optimizer_impl=optimizer_impl, compile=compile,
                        splice_lr_mult=splice_lr_mult)
        check_training_options(**training)
        self.save_hyperparameters({**config.to_dict(), **training})
        self.config = config.replace(vocab_size=int(math.ceil(config.vocab_size / vocab_multiple) * vocab_multiple))
        self.model = GPT(self.config)
        if init_from:
            self._init_from(init_from)
        self.val_loss_mean = MeanMetric()
        # throughput bookkeeping (restored on resume)
        self._tokens_seen = 0.0
        self._train_time = 0.0
        self._t_last: Optional[float] = None
        self._rate_ema: Optional[float] = None

    def _init_from(self, path: str) -> None:
        from models.checkpoint import CheckpointError, load_gpt_checkpoint

        try:
            model, cfg, _ = load_gpt_checkpoint(path)
        except CheckpointError as e:
            raise TrainingConfigError(f"model.init_from: {e}") from None
        diff = self._arch_diff(cfg)
        if diff:
            flags = " ".join(f"--model.{k} {'null' if v[0] is None else v[0]}" for k, v in diff.items())
            raise TrainingConfigError(f"model.init_from={path!r}: its model differs from the configured one (field: "
                                      f"(checkpoint, config)) {diff}; match it, e.g. {flags}")
        self.model.load_state_dict(model.state_dict())

    def _arch_diff(self, stored: GPTConfig) -> dict:
        """``{field: (stored, configured)}`` for the architecture fields (:meth:`GPTConfig.architecture`) where a
        stored config differs from ours."""
        ours, theirs = self.config.architecture(), stored.architecture()
        return {k: (theirs[k], v) for k, v in ours.items() if theirs[k] != v}

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        x, y = batch  # (B, T) inputs and next-token targets
        logits = self.model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        return loss, y.numel()

    # ------------------------------------------------------------------------------------------------ train
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def on_fit_start(self) -> None:
        """Refuse ``attn_backend='flash'`` where it cannot run (CPU, fp32, not installed) before any step, with one
        message naming the option instead of an error deep inside the first forward pass."""
        if self.config.attn_backend != "flash":
            return
        from models.attention import flash_unsupported_reason

        precision = str(getattr(self.trainer, "precision", "32")) if self._trainer is not None else "32"
        dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
        reason = flash_unsupported_reason(self.device, dtype, self.config.head_size)
        if reason is not None:
            raise TrainingConfigError(f"model.attn_backend=flash cannot run here: {reason}; use --model.attn_backend "
                                      f"auto or sdpa")

    def configure_model(self) -> None:
        if self.hparams.compile and not getattr(self, "_compiled", False):
            self.model.compile()  # in place: state_dict keys unchanged
            self._compiled = True

    def on_train_start(self) -> None:
        self._t_last = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        dt = now - (self._t_last if self._t_last is not None else now)
        self._t_last = now
        tokens = float(batch[0].numel() * self.trainer.world_size)
        self._tokens_seen += tokens
        self._train_time += dt
        if dt > 0:  # smoothed over ~10 steps for the progress bar; exact average = tokens / train_time_s
            rate = tokens / dt
            self._rate_ema = rate if self._rate_ema is None else 0.9 * self._rate_ema + 0.1 * rate
            self.log("tokens_per_sec", self._rate_ema, prog_bar=True, on_step=True, on_epoch=False)
        self.log("tokens", self._tokens_seen, on_step=True, on_epoch=False)
        self.log("train_time_s", self._train_time, on_step=True, on_epoch=False)
        opt = self.trainer.optimizers[0] if self.trainer.optimizers else None
        if opt is not None:
            self.log("lr", opt.param_groups[0]["lr"], on_step=True, on_epoch=False)

    # ------------------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, n = self._loss(batch)
        self.val_loss_mean.update(loss.detach(), weight=n)  # token-weighted: the mean over all val tokens

    def on_validation_epoch_end(self) -> None:
        val_loss = self.val_loss_mean.compute()  # synced across devices
        self.val_loss_mean.reset()
        # already reduced over all devices by the metric; sync_dist only averages identical values
        self.log("val_loss", val_loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", torch.exp(val_loss), sync_dist=True)

    def on_validation_end(self) -> None:
        # validation (and the checkpoint written after it) does not count as training time
        if self._t_last is not None:
            self._t_last = time.perf_counter()

    # ------------------------------------------------------------------------------------------------ optimiser
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        max_steps = int(self.trainer.max_steps) if self.trainer is not None else -1
        check_schedule(hp.warmup_steps, max_steps)
        impl = hp.get("optimizer_impl", "auto")
        fused = impl == "fused" or (impl == "auto" and self.device.type == "cuda")
        mult = hp.get("splice_lr_mult", 1.0)
        groups = param_groups(self.model, hp.weight_decay, splice_lr=hp.learning_rate * mult if mult != 1.0 else None)
        opt = torch.optim.AdamW(groups, lr=hp.learning_rate,
                                betas=tuple(hp.betas), eps=hp.eps, fused=fused, foreach=None if fused else True)
        warmup, min_ratio = int(hp.warmup_steps), float(hp.min_lr_ratio)

        def schedule(step: int) -> float:  # a plain function: not stored in checkpoints, always today's max_steps
            return lr_factor(step, warmup, max_steps, min_ratio)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip as configured (``trainer.gradient_clip_val`` / ``_algorithm``), also for fused AdamW under mixed
        precision, which Lightning's plugin refuses ("performs unscaling of gradients internally"): with an fp16
        grad scaler the gradients are unscaled first (the scaler then steps the optimizer without unscaling again);
        bf16 and fp32 have none, so the gradients are already true."""
        if not gradient_clip_val:
            return
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # Lightning's own path
            return
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val, foreach=True)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val, foreach=True)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from models.checkpoint import CKPT_FORMAT, CKPT_FORMAT_KEY, GPT_CONFIG_KEY

        checkpoint[CKPT_FORMAT_KEY] = CKPT_FORMAT
        checkpoint[GPT_CONFIG_KEY] = self.config.to_dict()
        checkpoint["kvsplice_train_stats"] = {"tokens": float(self._tokens_seen), "train_time_s": float(self._train_time)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from models.checkpoint import CKPT_FORMAT, CKPT_FORMAT_KEY, GPT_CONFIG_KEY, CheckpointError

        fmt = checkpoint.get(CKPT_FORMAT_KEY)
        if fmt != CKPT_FORMAT:
            raise CheckpointError(f"cannot resume: checkpoint format {fmt!r}, this version writes {CKPT_FORMAT}")
        stored = checkpoint.get(GPT_CONFIG_KEY)
        if not isinstance(stored, dict):
            raise CheckpointError(f"cannot resume: the checkpoint has no {GPT_CONFIG_KEY!r} dict")
        try:  # a checkpoint of an earlier version: old field names read as the new ones, newer fields at default
            stored_config = GPTConfig.from_dict(stored)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"cannot resume: the checkpoint's model config is not valid here: {e}") from None
        diff = self._arch_diff(stored_config)
        if diff:
            raise CheckpointError(
                f"cannot resume: the checkpoint's model differs from the configured one (field: (checkpoint, "
                f"config)) {diff}")
        self._check_resumed_tensors(checkpoint)
        stats = checkpoint.get("kvsplice_train_stats") or {}
        self._tokens_seen = float(stats.get("tokens", 0.0))
        self._train_time = float(stats.get("train_time_s", 0.0))

    def _check_resumed_tensors(self, checkpoint: dict[str, Any]) -> None:
        """Before Lightning loads anything: the checkpoint's weights are exactly this model's (names, shapes,
        floating point, finite), its optimizer has the parameter groups this run builds, and its optimizer state is
        finite — a NaN weight or moment would train on NaN and overwrite ``last.ckpt`` with it. Raises
        :class:`~models.checkpoint.CheckpointError` (one line)."""
        from models.checkpoint import CheckpointError, check_tensor

        sd = checkpoint.get("state_dict")
        if not isinstance(sd, dict):
            raise CheckpointError(f"cannot resume: the checkpoint's 'state_dict' is a {type(sd).__name__}, "
                                  f"expected a dict")
        expected = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
        if missing or unexpected:
            what = (f"lacks {missing[0]}" if missing else f"holds {unexpected[0]}, which this model does not have")
            raise CheckpointError(f"cannot resume: the checkpoint's weights are not this model's: it {what} "
                                  f"({len(missing)} missing, {len(unexpected)} unexpected)")
        opts = checkpoint.get("optimizer_states") or []
        if opts and isinstance(opts[0], dict):  # the groups configure_optimizers will build, by name and size
            mult = self.hparams.get("splice_lr_mult", 1.0)
            ours = [(g["name"], len(g["params"]))
                    for g in param_groups(self.model, 0.0, splice_lr=1.0 if mult != 1.0 else None)]
            stored = [(g.get("name"), len(g.get("params", []))) for g in opts[0].get("param_groups", [])]
            if stored != ours:
                def show(groups: list) -> str:
                    return ", ".join(f"{n}({k})" for n, k in groups)

                raise CheckpointError(
                    f"cannot resume: optimizer groups {show(stored)} in the checkpoint, {show(ours)} with these "
                    f"options (give the --model.splice_lr_mult it was trained with)")
        try:
            for name, want in expected.items():
                check_tensor(sd[name], "cannot resume: the checkpoint", name, shape=tuple(want.shape),
                             floating=want.is_floating_point())
            for i, opt in enumerate(opts):
                for pid, state in ((opt or {}).get("state") or {}).items():
                    for key, t in (state or {}).items():
                        if isinstance(t, torch.Tensor) and t.is_floating_point():
                            check_tensor(t, "cannot resume: the checkpoint",
                                         f"optimizer_states[{i}].state[{pid}].{key}")
        except ValueError as e:
            raise CheckpointError(str(e)) from None


def check_training_options(*, vocab_multiple: int, learning_rate: float, weight_decay: float, betas: tuple,
                           eps: float, warmup_steps: int, min_lr_ratio: float, optimizer_impl: str,
                           splice_lr_mult: float, **_: Any) -> None:
    """Raise :class:`TrainingConfigError` (naming ``model.OPTION``) for a training option out of its range."""
    if vocab_multiple < 1:
        raise TrainingConfigError(f"model.vocab_multiple must be >= 1, got {vocab_multiple}")
    if not learning_rate > 0 or not math.isfinite(learning_rate):
        raise TrainingConfigError(f"model.learning_rate must be a finite number > 0, got {learning_rate}")
    if learning_rate > MAX_LEARNING_RATE:
        raise TrainingConfigError(f"model.learning_rate {learning_rate:g} is above {MAX_LEARNING_RATE:g}: every step "
                                  f"would move each weight by more than its size (usual: 1e-5 to 1e-2)")
    if not 0 <= weight_decay <= 10:
        raise TrainingConfigError(f"model.weight_decay must be in [0, 10] (AdamW shrinks each weight by lr x decay a "
                                  f"step; usual 0.01 to 0.1), got {weight_decay}")
    if warmup_steps < 0:
        raise TrainingConfigError(f"model.warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise TrainingConfigError(f"model.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise TrainingConfigError(f"model.betas must be two numbers in [0, 1), got {betas}")
    if not eps > 0:
        raise TrainingConfigError(f"model.eps must be > 0, got {eps}")
    if not splice_lr_mult > 0 or not math.isfinite(splice_lr_mult):
        raise TrainingConfigError(f"model.splice_lr_mult must be a finite number > 0, got {splice_lr_mult}")
    if optimizer_impl not in ("auto", "fused", "foreach"):
        raise TrainingConfigError(f"model.optimizer_impl must be auto, fused or foreach, got {optimizer_impl!r}")


def check_schedule(warmup_steps: int, max_steps: int) -> None:
    """Raise :class:`TrainingConfigError` unless ``0 <= warmup_steps < max_steps`` and ``max_steps`` is set."""
    if max_steps is None or max_steps < 1:
        raise TrainingConfigError(
            f"trainer.max_steps must be set to a positive number of optimizer steps (got {max_steps}); the cosine "
            f"learning-rate schedule is defined on it (e.g. --trainer.max_steps 2000)")
    if warmup_steps >= max_steps:
        raise TrainingConfigError(
            f"model.warmup_steps ({warmup_steps}) must be smaller than trainer.max_steps ({max_steps})")
