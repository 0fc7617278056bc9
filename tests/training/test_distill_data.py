"""``training.distill_data``: long windows of mixed lengths within the model's positions, the same tokens every step,
contiguous text, resumable by step, disjoint across DDP processes."""

from __future__ import annotations

import pytest
import torch

from training.distill_data import StepWindows, window_lengths


@pytest.mark.parametrize("requested,positions,want", [(None, 8192, (1024, 2048)), (None, 2048, (1024, 2048)),
                                                      (None, 1500, (1024,)), (None, 512, (256, 512)),
                                                      (None, None, (1024, 2048)), ([64, 32], 512, (64, 32))])
def test_window_lengths(requested, positions, want):
    assert window_lengths(requested, positions) == want


def test_steps_alternate_lengths_at_constant_tokens_over_contiguous_text():
    ids = torch.arange(50_000)
    w = StepWindows(ids, (1024, 2048), 2048)
    shapes = [tuple(w.batch(s).shape) for s in range(4)]
    assert shapes == [(2, 1025), (1, 2049), (2, 1025), (1, 2049)]
    assert {(b * (t - 1)) for b, t in shapes} == {2048}  # tokens per step
    for s in range(30):  # 30 steps wrap around the stream: every window is still one piece of text
        x = w.batch(s)
        assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones_like(x[:, 1:]))
    assert torch.equal(w.batch(7), StepWindows(ids, (1024, 2048), 2048).batch(7))  # a resume reads the same


def test_processes_of_one_step_read_different_windows():
    w = StepWindows(torch.arange(100_000), (1024, 2048), 2048)
    for s in range(3):
        starts = [set(w.batch(s, rank, 2)[:, 0].tolist()) for rank in range(2)]
        assert not starts[0] & starts[1]
    assert torch.equal(w.batch(1, 0, 2)[:, 0], torch.tensor([2 * 2048]))  # step 1 of rank 0 after step 0 of both


def test_too_short_a_stream_is_refused():
    with pytest.raises(ValueError, match="too few"):
        StepWindows(torch.arange(1000), (1024,), 1024)
