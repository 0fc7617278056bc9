"""The LightningModule of ``kvsplice distill``: a converted MLA model (:class:`models.mla_llama.MLALlama`)
fine-tuned on local text with the LM loss or KL distillation from its source model (X-EcoMLA: fewer tokens) — or an
unconverted transformers causal LM (the source itself) fine-tuned the same way, the same-text baseline a converted
model's recovery is measured against (so adapting to the text is not counted as recovery).

Batches come from the step counter, not a sampler (:class:`training.distill_data.StepWindows`: mixed lengths,
constant tokens per step), so a resumed run (``--ckpt-path last``) sees exactly the batches an uninterrupted one
would. The teacher is held outside the module's parameters (never trained nor checkpointed). ``trainable="attention"``
trains only the attention modules (the converted part): no weight gradients nor AdamW state for the MLPs, embeddings
and head. With a clock (:class:`training.distill_budget.TimeBudget` with minutes) the learning rate decays over the
time budget instead of ``max_steps``.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F

from models.mla_llama import MLALlama
from training.distill_budget import TimeBudget, time_lr_factor
from training.distill_data import StepWindows
from training.distill_loss import kl_and_lm
from training.lit import lr_factor

__all__ = ["LOSSES", "LitDistill", "STUDENT_CONFIG_KEY", "TRAINABLE", "causal_logits", "attention_only",
           "student_config"]

LOSSES = ("kl", "lm")
TRAINABLE = ("all", "attention")
STUDENT_CONFIG_KEY = "student_config"


def causal_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(B, T, V)`` of our MLA model or a transformers causal LM (``use_cache=False``: no K/V copies)."""
    if isinstance(model, MLALlama):
        return model(ids)
    return model(input_ids=ids, use_cache=False).logits


def student_config(model: torch.nn.Module) -> dict[str, Any]:
    """The student's config as plain data (what a resumed run must match)."""
    if isinstance(model, MLALlama):
        return model.cfg.to_dict()
    import json

    return json.loads(model.config.to_json_string(use_diff=False))


def attention_only(model: torch.nn.Module) -> int:
    """Freeze every parameter outside the attention modules (ours ``.attn.``, transformers' ``.self_attn.``);
    returns how many parameters stay trainable."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(".attn." in name or ".self_attn." in name)
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no attention parameters to train (.attn. / .self_attn.)")
    return n


class LitDistill(L.LightningModule):
    def __init__(self, student: torch.nn.Module, windows: StepWindows, val_windows: torch.Tensor, *,
                 teacher: Optional[torch.nn.Module] = None, loss: str = "kl", lr: float = 1e-4,
                 warmup_steps: int = 10, max_steps: int = 100, temperature: float = 1.0, min_lr_ratio: float = 0.1,
                 trainable: str = "all", clock: Optional[TimeBudget] = None) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if loss == "kl" and teacher is None:
            raise ValueError("KL distillation needs the teacher (the source model)")
        if trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
        self.student = student
        if trainable == "attention":
            attention_only(student)
        self._teacher = [teacher.eval().requires_grad_(False)] if teacher is not None else []  # not a submodule
        self.windows, self.val_windows = windows, val_windows  # step batches, (Nv, T + 1) token ids
        self.loss_kind, self.lr, self.temperature = loss, lr, temperature
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        self.clock = clock
        self.tokens_seen = 0.0

    def _world(self) -> tuple[int, int]:
        t = self._trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def _batch(self, step: int) -> torch.Tensor:
        rank, world = self._world()
        return self.windows.batch(step, rank, world).to(self.device)  # (B, L + 1)

    def _teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        teacher = self._teacher[0]
        teacher.to(self.device)
        with torch.no_grad():
            return causal_logits(teacher, x).float()  # (B, T, V)

    def losses(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``lm`` (next-token CE of the student) and, with a teacher, ``kl`` = KL(teacher ‖ student) per token
        (:func:`training.distill_loss.kl_and_lm`: then ``lm`` is reported without a gradient)."""
        x, y = ids[:, :-1], ids[:, 1:]  # (B, T) each
        logits = causal_logits(self.student, x).float()  # (B, T, V)
        if self._teacher and self.loss_kind == "kl":
            return kl_and_lm(logits, self._teacher_logits(x), y, self.temperature)
        return {"lm": F.cross_entropy(logits.flatten(0, 1), y.flatten())}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # the logger's step is the optimizer step (no accumulation); Lightning restores it off by one from a
        # checkpoint saved at an early stop (the --minutes budget), which would log a step twice or skip one
        self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.global_step
        ids = self._batch(self.global_step)
        parts = self.losses(ids)
        loss = parts[self.loss_kind]
        self.tokens_seen += ids[:, :-1].numel() * self._world()[1]  # every process's batch
        self.log_dict({f"train_{k}": v.detach() for k, v in parts.items()}, prog_bar=True)
        self.log("tokens", self.tokens_seen)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        if self.clock is not None:
            self.log("minutes", self.clock.elapsed_s() / 60.0)
            if self.clock.minutes:
                self.log("min_left", self.clock.minutes_left(), prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        parts = self.losses(batch.to(self.device))
        self.log("val_loss", parts["lm"], prog_bar=True, batch_size=batch.shape[0], sync_dist=True)
        if "kl" in parts:
            self.log("val_kl", parts["kl"], batch_size=batch.shape[0], sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.student.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self._lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _lr_factor(self, step: int) -> float:
        """Warmup, then cosine decay over the time budget (with a clock that has minutes) or ``max_steps``."""
        if self.clock is not None and self.clock.minutes:
            return time_lr_factor(step, self.clock.progress(), self.warmup_steps, self.min_lr_ratio)
        return lr_factor(step, self.warmup_steps, self.max_steps, self.min_lr_ratio)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[STUDENT_CONFIG_KEY] = student_config(self.student)
        checkpoint["kvsplice_train_stats"] = {"tokens": float(self.tokens_seen)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from models.checkpoint import CheckpointError

        if checkpoint.get(STUDENT_CONFIG_KEY) != student_config(self.student):
            raise CheckpointError("cannot resume: the checkpoint's model is not the --model being fine-tuned")
        self.tokens_seen = float((checkpoint.get("kvsplice_train_stats") or {}).get("tokens", 0.0))
