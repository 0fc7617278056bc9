"""The batches of ``kvsplice distill``, chosen by the optimizer step: mixed window lengths, constant tokens per step.

Retrieval lives at long range, so the default windows are long (1,024 and 2,048 tokens, alternating by step within
the model's positions), and a step of length ``L`` takes ``step_tokens // L`` windows, so every optimizer step sees
about the same number of tokens. Step ``s`` of process ``rank`` (of ``world`` DDP processes) reads consecutive
windows from offset ``(s · world + rank) · step_tokens`` of the token stream (modulo the stream, windows never
crossing its end): a resumed run sees exactly the batches an uninterrupted one would, and DDP processes never share
a window within a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["DEFAULT_LENGTHS", "StepWindows", "window_lengths"]

DEFAULT_LENGTHS = (1024, 2048)


def window_lengths(requested: Optional[Sequence[int]], max_positions: Optional[int]) -> tuple[int, ...]:
    """The window lengths: ``requested`` as given (``--seq-len``), else :data:`DEFAULT_LENGTHS` within the model's
    positions (a model with fewer than 1,024: half its positions and all of them)."""
    if requested:
        return tuple(int(t) for t in requested)
    if not max_positions:
        return DEFAULT_LENGTHS
    fit = tuple(t for t in DEFAULT_LENGTHS if t <= max_positions)
    return fit or tuple(sorted({max(1, max_positions // 2), max_positions}))


@dataclass(frozen=True)
class StepWindows:
    """Windows of ``ids`` (1-D) for each optimizer step: ``lengths[s % len(lengths)]`` long, ``step_tokens`` tokens
    per step (at least one window)."""

    ids: torch.Tensor  # (N,) token ids
    lengths: tuple[int, ...]
    step_tokens: int

    def __post_init__(self) -> None:
        if self.ids.numel() < max(self.lengths) + 2:
            raise ValueError(f"{self.ids.numel()} tokens, too few for a window of {max(self.lengths)}")

    def shape(self, step: int) -> tuple[int, int]:
        """``(windows, length)`` of step ``step``."""
        t = self.lengths[step % len(self.lengths)]
        return max(1, self.step_tokens // t), t

    def batch(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """``(B, L + 1)`` ids: inputs and their next-token targets."""
        b, t = self.shape(step)
        room = self.ids.numel() - t  # window starts 0 .. room - 1 fit whole (inputs and the last target)
        start = (step * world + rank) * self.step_tokens
        pos = (start + torch.arange(b) * t) % room  # (B,)
        return self.ids[pos[:, None] + torch.arange(t + 1)]  # (B, L + 1)
