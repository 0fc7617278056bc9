"""Token shards (flat ``uint16`` ``.bin`` files read through ``np.memmap``) and the block datasets built on them.

A prepared source is a folder ``<cache_dir>/<name>-<key>/`` holding ``train.bin``, ``val.bin`` and ``meta.json``.
It is built in a temporary folder and renamed into place at the end, so a folder with a ``meta.json`` is always
complete, concurrent preparers never see half-written shards, and a second prepare just reuses it.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from data.errors import DataConfigError
from data.tokenizer import TextTokenizer

__all__ = [
    "SHARD_DTYPE",
    "FixedBlocks",
    "RandomBlocks",
    "ShardWriter",
    "build_shards",
    "read_meta",
    "split_tail",
    "unigram_entropy",
]

SHARD_DTYPE = np.uint16
META_NAME = "meta.json"
SHARD_FORMAT_VERSION = 1
_ENCODE_BATCH = 1024  # stories per encode_batch call
_COUNT_CHUNK = 1 << 24  # tokens per bincount chunk


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the empirical unigram distribution of ``tokens``.

    It is the cross-entropy of the best context-free predictor, so a language model's validation loss should be far
    below it. Memory-light on large memmaps (counted in chunks).

    Args:
        tokens: (N,) integer token ids in ``[0, vocab_size)``.
        vocab_size: number of token ids.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)  # (V,)
    for start in range(0, len(tokens), _COUNT_CHUNK):
        counts += np.bincount(np.asarray(tokens[start : start + _COUNT_CHUNK]), minlength=vocab_size)[:vocab_size]
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


class ShardWriter:
    """Append tokenised stories, each followed by the end-of-text token, to a ``uint16`` file.

    Args:
        path: output ``.bin`` file (created/truncated).
        tokenizer: encodes the stories; its ``vocab_size`` must fit ``uint16``.
    """

    def __init__(self, path: Path, tokenizer: TextTokenizer) -> None:
        if tokenizer.vocab_size > np.iinfo(SHARD_DTYPE).max + 1:
            raise ValueError(f"vocab_size {tokenizer.vocab_size} does not fit uint16 shards")
        self.path = path
        self.tokenizer = tokenizer
        self.tokens = 0
        self.stories = 0
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()

    def write(self, stories: list[str]) -> None:
        """Encode and append a batch of stories."""
        if not stories:
            return
        eot = self.tokenizer.eot_id
        ids = self.tokenizer.encode_batch(stories)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))  # (B,)
        body = np.fromiter(itertools.chain.from_iterable(ids), dtype=SHARD_DTYPE, count=int(lengths.sum()))
        flat = np.insert(body, np.cumsum(lengths), eot)  # (sum(lengths) + B,): story, eot, story, eot, ...
        flat.tofile(self._f)
        self.tokens += len(flat)
        self.stories += len(stories)

    def close(self) -> None:
        """Flush and close the file."""
        self._f.close()


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def write_split(
    stories: Iterable[str], path: Path, tokenizer: TextTokenizer, desc: str, total: int | None = None
) -> dict[str, int]:
    """Tokenise ``stories`` into ``path`` with a progress bar; returns ``{"tokens": ..., "stories": ...}``."""
    writer = ShardWriter(path, tokenizer)
    try:
        with tqdm(total=total, desc=desc, unit=" stories", unit_scale=True, mininterval=0.5, leave=False) as bar:
            for batch in _batched(stories, _ENCODE_BATCH):
                writer.write(batch)
                bar.update(len(batch))
    finally:
        writer.close()
    return {"tokens": writer.tokens, "stories": writer.stories}


def split_tail(train: Path, val: Path, fraction: float, eot_id: int) -> tuple[dict[str, int], dict[str, int]]:
    """Move the last ``fraction`` of ``train``'s tokens (cut after a story's end-of-text token) into ``val``.

    Returns:
        ``(train_stats, val_stats)`` dicts with ``tokens`` and ``stories`` counts.

    Raises:
        ValueError: the shard holds fewer than two stories, so no split is possible.
    """
    tokens = np.memmap(train, dtype=SHARD_DTYPE, mode="r")  # (N,)
    n = len(tokens)
    eots = np.flatnonzero(np.asarray(tokens) == eot_id)  # story ends, (S,)
    if len(eots) < 2:
        raise ValueError(f"{train}: need at least 2 stories to hold out a validation split, found {len(eots)}")
    # Cut after the story end closest to (1 - fraction) * n, keeping >= 1 story on each side.
    k = int(np.clip(np.searchsorted(eots, (1.0 - fraction) * n), 0, len(eots) - 2))
    cut = int(eots[k]) + 1
    np.asarray(tokens[cut:]).tofile(val)
    del tokens
    with open(train, "r+b") as f:
        f.truncate(cut * np.dtype(SHARD_DTYPE).itemsize)
    return {"tokens": cut, "stories": k + 1}, {"tokens": n - cut, "stories": len(eots) - k - 1}


def read_meta(folder: Path) -> dict | None:
    """The folder's ``meta.json`` if the shards it describes are complete, else ``None``."""
    meta_path = folder / META_NAME
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        for split in meta["splits"].values():
            if (folder / split["file"]).stat().st_size != split["tokens"] * np.dtype(SHARD_DTYPE).itemsize:
                return None
    except (OSError, ValueError, KeyError):
        return None
    return meta


def build_shards(
    folder: Path,
    tokenizer: TextTokenizer,
    write: Callable[[Path], dict[str, dict[str, int]]],
    source: dict[str, object],
) -> dict:
    """Build ``folder`` (train.bin, val.bin, meta.json) unless it is already complete; returns its metadata.

    Args:
        folder: final shard folder.
        tokenizer: the tokenizer used (recorded in the metadata, its vocab size sizes the unigram statistics).
        write: ``write(tmp_folder) -> {"train": stats, "validation": stats}`` writes ``train.bin`` and ``val.bin``
            into a temporary folder.
        source: JSON-friendly description of the source (recorded in the metadata).
    """
    if (meta := read_meta(folder)) is not None:
        return meta
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        t0 = time.perf_counter()
        stats = write(tmp)
        train_tokens = np.memmap(tmp / "train.bin", dtype=SHARD_DTYPE, mode="r")
        meta = {
            "format_version": SHARD_FORMAT_VERSION,
            "dtype": np.dtype(SHARD_DTYPE).name,
            "source": source,
            "tokenizer": {
                "name": tokenizer.name,
                "vocab_size": tokenizer.vocab_size,
                "eot_id": tokenizer.eot_id,
                "fingerprint": tokenizer.fingerprint,
            },
            "splits": {
                "train": {"file": "train.bin", **stats["train"]},
                "validation": {"file": "val.bin", **stats["validation"]},
            },
            "unigram_entropy": unigram_entropy(train_tokens, tokenizer.vocab_size),
            "build_seconds": round(time.perf_counter() - t0, 3),
        }
        del train_tokens
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first: keep its (identical) shards
            if read_meta(folder) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = read_meta(folder)
    assert result is not None, f"shards in {folder} are incomplete"
    return result


# --------------------------------------------------------------------------------------------------------------------
# Block datasets
# --------------------------------------------------------------------------------------------------------------------


class _Shard:
    """Lazily opened read-only memmap; pickles as its path (cheap for DataLoader workers)."""

    def __init__(self, path: Path, block_size: int) -> None:
        self.path = Path(path)
        self.block_size = block_size
        self.num_tokens = self.path.stat().st_size // np.dtype(SHARD_DTYPE).itemsize
        if self.num_tokens < block_size + 1:
            raise DataConfigError(
                f"{self.path} holds {self.num_tokens} tokens, fewer than block_size + 1 = {block_size + 1}"
            )
        self._tokens: np.memmap | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    def block(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: tokens ``[offset, offset + T)`` and ``[offset + 1, offset + T + 1)``, each (T,) int64."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=SHARD_DTYPE, mode="r")
        chunk = torch.from_numpy(self._tokens[offset : offset + self.block_size + 1].astype(np.int64))  # (T+1,)
        return chunk[:-1], chunk[1:]

    @property
    def max_offset(self) -> int:
        """Largest valid block start."""
        return self.num_tokens - self.block_size - 1


class RandomBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Training blocks at random offsets of a shard.

    Item ``draw`` (any non-negative int, see :class:`~data.sampler.EpochSampler`) is the block at an offset drawn
    from a generator seeded by ``(seed, draw)``: deterministic, independent of workers/ranks, and stateless (DDP- and
    persistent-worker-friendly). ``len()`` is the number of draws per epoch.

    Args:
        path: the ``uint16`` shard.
        block_size: T, tokens per example.
        num_samples: draws per epoch.
        seed: base seed.
    """

    def __init__(self, path: Path, block_size: int, num_samples: int, seed: int) -> None:
        self.shard = _Shard(path, block_size)
        self.num_samples = num_samples
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def offset(self, draw: int) -> int:
        """The block start for ``draw``."""
        rng = np.random.default_rng((self.seed, int(draw)))
        return int(rng.integers(0, self.shard.max_offset + 1))

    def __getitem__(self, draw: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shard.block(self.offset(draw))  # (T,), (T,)


class FixedBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``num_blocks`` validation blocks at fixed offsets spread evenly over a shard (overlapping if it is short).

    Args:
        path: the ``uint16`` shard.
        block_size: T, tokens per example.
        num_blocks: number of blocks.
    """

    def __init__(self, path: Path, block_size: int, num_blocks: int) -> None:
        self.shard = _Shard(path, block_size)
        self.offsets = np.linspace(0, self.shard.max_offset, num_blocks).round().astype(np.int64)  # (num_blocks,)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shard.block(int(self.offsets[i]))  # (T,), (T,)
