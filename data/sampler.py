"""The order training reads its random blocks in, resumable mid-epoch: :class:`EpochSampler` (fresh draw ids per
epoch, split over ranks) and :class:`ResumableDataLoader` (Lightning's stateful-dataloader protocol: a checkpoint
records how far into its epoch the batches reached, and a resumed run skips exactly those)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["EpochSampler", "ResumableDataLoader"]


class EpochSampler(DistributedSampler):
    """Yields the draw ids of epoch ``e`` — ``e * n, ..., e * n + n - 1`` — so every epoch sees fresh random blocks.

    With ``num_replicas > 1`` each rank gets every ``num_replicas``-th id of the epoch (starting at ``rank``; the epoch
    is padded by wrapping around to a multiple of ``num_replicas``), exactly what Lightning's
    ``DistributedSamplerWrapper`` around the single-process sampler would give. Being a ``DistributedSampler`` it is
    used as is under DDP (Lightning replaces only samplers that are not one).

    Lightning calls :meth:`set_epoch` at each epoch start. :meth:`skip_next` makes the next pass start later in its
    epoch: :class:`ResumableDataLoader` uses it to resume mid-epoch on the batches an uninterrupted run would see.

    Args:
        num_samples: draws per epoch, ``n`` (all ranks together).
        num_replicas: number of ranks sharing each epoch.
        rank: this process's rank.
    """

    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        super().__init__(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.epoch_size = num_samples
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose draws are yielded next."""
        self.epoch = int(epoch)

    def skip_next(self, count: int) -> None:
        """The next pass (only) leaves out the first ``count`` draws of this rank's share of its epoch."""
        self._skip = max(0, int(count))

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        n, base = self.epoch_size, self.epoch * self.epoch_size
        return iter([base + (self.rank + k * self.num_replicas) % n for k in range(skip, self.num_samples)])

    def __len__(self) -> int:
        return self.num_samples  # this rank's share of a whole epoch (also when a pass is shortened by skip_next)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over an :class:`EpochSampler` that follows Lightning's stateful-dataloader protocol.

    :meth:`state_dict` says how far into which epoch the batches handed out so far reach; Lightning stores it in every
    checkpoint (``loops.fit_loop.state_dict.combined_loader``) and calls :meth:`load_state_dict` on resume before
    iterating, so the resumed pass skips exactly those draws (cheaply: by id, no data is read) and continues with the
    batches the uninterrupted run would have trained on. Lightning does not pre-fetch batches from loaders of known
    length, so "handed out" is "trained on". The state is plain ints (checkpoints stay ``weights_only``-loadable).

    Takes ``DataLoader``'s arguments; ``sampler`` must be an :class:`EpochSampler`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, EpochSampler):
            raise TypeError(f"ResumableDataLoader needs an EpochSampler, got {type(self.sampler).__name__}")
        self._epoch: int | None = None  # epoch of the current (last) pass
        self._served = 0  # this rank's draws of that epoch handed out so far (including skipped ones)
        self._pending: tuple[int, int] | None = None  # (epoch, draws) to skip when that epoch's pass starts

    def __iter__(self) -> Iterator[Any]:
        # A generator: the body runs at the first next(), after Lightning's set_epoch for this epoch.
        sampler: EpochSampler = self.sampler  # type: ignore[assignment]
        skip = 0
        if self._pending is not None:
            epoch, skip = self._pending
            self._pending = None
            if epoch != sampler.epoch:
                skip = 0
        sampler.skip_next(skip)
        self._epoch, self._served = sampler.epoch, skip
        step = self.batch_size or 1
        for batch in super().__iter__():
            self._served = min(self._served + step, len(sampler))
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "samples", "num_replicas"}``: this rank's draws of ``epoch`` already handed out."""
        sampler: EpochSampler = self.sampler  # type: ignore[assignment]
        if self._epoch is None:
            return {"epoch": sampler.epoch, "samples": 0, "num_replicas": sampler.num_replicas}
        return {"epoch": self._epoch, "samples": self._served, "num_replicas": sampler.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next pass over ``state["epoch"]`` start after its ``state["samples"]`` draws (per rank).

        A finished epoch means "start the next one from its beginning". Resuming on a different number of devices
        keeps the global position (approximately, with a warning): exact resume needs the same device count.
        """
        sampler: EpochSampler = self.sampler  # type: ignore[assignment]
        epoch, samples = int(state["epoch"]), int(state["samples"])
        replicas = int(state.get("num_replicas", sampler.num_replicas))
        if replicas != sampler.num_replicas:
            warnings.warn(f"resuming on {sampler.num_replicas} devices from a checkpoint of {replicas}: the data "
                          f"position is kept approximately, not exactly", stacklevel=2)
            samples = samples * replicas // sampler.num_replicas
        if samples >= len(sampler):
            epoch, samples = epoch + 1, 0
        self._pending = (epoch, samples)
