"""The LightningModule of ``python -m training.distill``: a converted MLA model (:class:`models.mla_llama.MLALlama`)
fine-tuned on local text with the LM loss or KL distillation from its source model (X-EcoMLA: fewer tokens) — or an
unconverted transformers causal LM (the source itself) fine-tuned the same way, the same-text baseline a converted
model's recovery is measured against (so adapting to the text is not counted as recovery).

Batches come from the step counter, not a sampler: optimizer step ``s`` trains on windows
``(s·B + j) mod N`` of the token windows, so a resumed run (``--ckpt-path last``) sees exactly the batches an
uninterrupted one would. The teacher is held outside the module's parameters (never trained nor checkpointed).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F

from models.mla_llama import MLALlama
from training.distill_loss import kl_and_lm
from training.lit import lr_factor

__all__ = ["LOSSES", "LitDistill", "STUDENT_CONFIG_KEY", "causal_logits", "student_config"]

LOSSES = ("kl", "lm")
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


class LitDistill(L.LightningModule):
    def __init__(self, student: torch.nn.Module, windows: torch.Tensor, val_windows: torch.Tensor, *,
                 teacher: Optional[torch.nn.Module] = None, loss: str = "kl", lr: float = 1e-4,
                 warmup_steps: int = 10, max_steps: int = 100, batch_size: int = 4, temperature: float = 1.0,
                 min_lr_ratio: float = 0.1) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if loss == "kl" and teacher is None:
            raise ValueError("KL distillation needs the teacher (the source model)")
        self.student = student
        self._teacher = [teacher.eval().requires_grad_(False)] if teacher is not None else []  # not a submodule
        self.windows, self.val_windows = windows, val_windows  # (N, T + 1), (Nv, T + 1) token ids
        self.loss_kind, self.lr, self.temperature = loss, lr, temperature
        self.warmup_steps, self.max_steps, self.batch_size, self.min_lr_ratio = (warmup_steps, max_steps,
                                                                                 batch_size, min_lr_ratio)
        self._tokens_seen, self._t0 = 0.0, None

    def _batch(self, step: int) -> torch.Tensor:
        n = self.windows.shape[0]
        rows = torch.arange(step * self.batch_size, (step + 1) * self.batch_size) % n
        return self.windows[rows].to(self.device)  # (B, T + 1)

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
        if self._t0 is None:
            self._t0 = time.perf_counter()
        ids = self._batch(self.global_step)
        parts = self.losses(ids)
        loss = parts[self.loss_kind]
        self._tokens_seen += ids[:, :-1].numel()
        self.log_dict({f"train_{k}": v.detach() for k, v in parts.items()}, prog_bar=True)
        self.log("tokens", self._tokens_seen)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        parts = self.losses(batch.to(self.device))
        self.log("val_loss", parts["lm"], prog_bar=True, batch_size=batch.shape[0])
        if "kl" in parts:
            self.log("val_kl", parts["kl"], batch_size=batch.shape[0])

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.AdamW(self.student.parameters(), lr=self.lr, weight_decay=0.0, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, self.warmup_steps, self.max_steps, self.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[STUDENT_CONFIG_KEY] = student_config(self.student)
        checkpoint["kvsplice_train_stats"] = {"tokens": float(self._tokens_seen)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from models.checkpoint import CheckpointError

        if checkpoint.get(STUDENT_CONFIG_KEY) != student_config(self.student):
            raise CheckpointError("cannot resume: the checkpoint's model is not the --model being fine-tuned")
        self._tokens_seen = float((checkpoint.get("kvsplice_train_stats") or {}).get("tokens", 0.0))
