"""LightningDataModule for TinyStories (Hugging Face Hub or local files) and the embedded offline synthetic stories.

Pipeline: stories (a :mod:`data.story_sources` source) -> tokenizer (:mod:`data.tokenizer_routes`) -> ``uint16``
token shards cached under ``cache_dir`` (once, idempotent; :mod:`data.shards`) -> random ``block_size + 1`` token
windows for training, a fixed evenly spaced set of windows for validation.
Batches are ``(x, y)`` int64 tensors of shape (B, T) with ``y`` = ``x`` shifted left by one token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from data.errors import DataConfigError, DataUnavailableError
from data.settings import check_settings
from data.sampler import EpochSampler, ResumableDataLoader
from data.shards import FixedBlocks, RandomBlocks, build_shards
from data.story_sources import HubStories, LocalStories, StorySource, SyntheticStories
from data.tokenizer import TextTokenizer
from data.tokenizer_routes import cache_key, check_cache_dir, pick_tokenizer

__all__ = ["TinyStoriesDataModule"]


class TinyStoriesDataModule(L.LightningDataModule):
    """TinyStories (or the embedded synthetic stories) as token blocks for causal language modelling.

    Sources, in order of precedence: ``synthetic=True`` (offline generator, its own small BPE tokenizer);
    ``path`` (local files); else the Hugging Face Hub ``dataset``. Without network and without ``path``/``synthetic``,
    :class:`~data.errors.DataUnavailableError` is raised with a one-line hint.

    Batches are ``(x, y)``: (B, T) int64 input ids and next-token targets.

    Args:
        path: local TinyStories data: a ``.txt`` file (stories separated by ``<|endoftext|>``, else by blank
            lines), a ``.json`` file (a list of strings, ``{"texts": [...]}`` or a list of ``{"text": ...}``), a
            ``.jsonl`` file, or a folder of such files (names containing ``val``/``valid`` form the validation split).
        val_path: optional separate local validation file or folder (overrides the name-based/held-out split).
        tokenizer_path: a folder (or file in it) with GPT-2-style BPE files ``vocab.json`` + ``merges.txt`` or
            ``encoder.json`` + ``vocab.bpe``, or a ``tokenizer.json``. Default: GPT-2 from the Hub (cached under
            ``cache_dir``), or for ``synthetic`` a byte-level BPE trained on the synthetic stories.
        dataset: Hugging Face Hub dataset id used when neither ``synthetic`` nor ``path`` is set (its ``train`` and
            ``validation`` splits; a ``text`` column).
        synthetic: use the embedded offline story generator (no files, no network).
        synthetic_stories: number of synthetic training stories (validation gets ``val_fraction`` as many more, from
            an independent random stream).
        synthetic_vocab_size: vocabulary size of the BPE tokenizer trained on the synthetic stories (incl.
            ``<|endoftext|>``).
        bpe_vocab_size: with ``path``: train a byte-level BPE of this many entries (incl. ``<|endoftext|>``) on the
            training files' stories (never on ``val_path``/validation files) instead of using GPT-2's 50,257-entry
            vocabulary, cached under ``cache_dir`` by the files' fingerprints (a small vocabulary keeps small models'
            embeddings and softmax cheap, as llama2.c's custom tokenizers do). Not with ``tokenizer_path``.
        block_size: T, tokens per training example (each example reads ``block_size + 1`` tokens).
        batch_size: examples per batch (per device).
        num_workers: DataLoader worker processes.
        cache_dir: where token shards and trained/downloaded tokenizers are cached (keyed by source and tokenizer).
        val_fraction: share of stories held out for validation when a local source or Hub dataset has no separate
            validation split; also the synthetic validation/training story ratio.
        train_batches_per_epoch: random training batches per epoch (global: split across DDP ranks).
        val_batches: validation batches (fixed blocks, the same every time).
        seed: seed of the synthetic stories and of the random block offsets.
    """

    def __init__(
        self,
        path: str | None = None,
        val_path: str | None = None,
        tokenizer_path: str | None = None,
        dataset: str = "roneneldan/TinyStories",
        synthetic: bool = False,
        synthetic_stories: int = 20000,
        synthetic_vocab_size: int = 2048,
        bpe_vocab_size: int | None = None,
        block_size: int = 1024,
        batch_size: int = 8,
        num_workers: int = 0,
        cache_dir: str = ".cache/data",
        val_fraction: float = 0.05,
        train_batches_per_epoch: int = 1000,
        val_batches: int = 20,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        check_settings(path=path, val_path=val_path, tokenizer_path=tokenizer_path, synthetic=synthetic,
                       synthetic_stories=synthetic_stories, synthetic_vocab_size=synthetic_vocab_size,
                       bpe_vocab_size=bpe_vocab_size, block_size=block_size, batch_size=batch_size,
                       num_workers=num_workers, val_fraction=val_fraction,
                       train_batches_per_epoch=train_batches_per_epoch, val_batches=val_batches, seed=seed)
        self.save_hyperparameters()
        self.path = path
        self.bpe_vocab_size = bpe_vocab_size
        self.val_path = val_path
        self.tokenizer_path = tokenizer_path
        self.dataset = dataset
        self.synthetic = synthetic
        self.synthetic_stories = synthetic_stories
        self.synthetic_vocab_size = synthetic_vocab_size
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir)
        self.val_fraction = val_fraction
        self.train_batches_per_epoch = train_batches_per_epoch
        self.val_batches = val_batches
        self.seed = seed

        self._tokenizer: TextTokenizer | None = None
        self.meta: dict[str, Any] | None = None  #: shard metadata (after prepare_data/setup)
        self.shard_dir: Path | None = None  #: folder with train.bin / val.bin / meta.json (after prepare_data/setup)
        self.train_set: RandomBlocks | None = None
        self.val_set: FixedBlocks | None = None

    @property
    def stories(self) -> StorySource:
        """Where the stories come from: ``synthetic``, else the local ``path``, else the Hub ``dataset``."""
        if self.synthetic:
            return SyntheticStories(self.synthetic_stories, self.seed, self.val_fraction)
        if self.path:
            return LocalStories(self.path, self.val_path, self.val_fraction)
        return HubStories(self.dataset, self.val_fraction)

    @property
    def source(self) -> str:
        """``"synthetic"``, ``"local"`` or ``"hub"``."""
        return self.stories.kind

    @property
    def tokenizer(self) -> TextTokenizer:
        """The tokenizer (``encode``, ``decode``, ``eot_id``, ``vocab_size``), loaded, downloaded or trained lazily.

        Raises:
            DataUnavailableError: it needs the Hub and the Hub is unreachable (or files are missing).
        """
        if self._tokenizer is None:
            self._tokenizer = pick_tokenizer(self.stories, tokenizer_path=self.tokenizer_path,
                                             synthetic_vocab_size=self.synthetic_vocab_size,
                                             bpe_vocab_size=self.bpe_vocab_size, cache_dir=self.cache_dir)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of :attr:`tokenizer` (cheap: loads/trains only the tokenizer, no shards)."""
        return self.tokenizer.vocab_size

    @property
    def eot_id(self) -> int:
        """Id of the end-of-text token separating stories."""
        return self.tokenizer.eot_id

    @property
    def unigram_entropy(self) -> float:
        """Unigram entropy (nats) of the training shard: a context-free model's loss; a LM should go far below."""
        return float(self._require_meta()["unigram_entropy"])

    def prepare_data(self) -> None:
        """Tokenise the source into cached ``uint16`` shards (no-op when they already exist).

        Raises:
            DataUnavailableError: data or tokenizer unavailable (offline Hub, missing path, unreadable files).
        """
        self.stories.check()  # a missing/empty data.path is reported before any tokenizer problem
        tok = self.tokenizer
        prefix, spec = self.stories.shard_spec()
        spec = {**spec, "tokenizer": tok.fingerprint}
        check_cache_dir(self.cache_dir)
        folder = self.cache_dir / f"{prefix}-{cache_key(spec)}"
        self.meta = build_shards(folder, tok, lambda tmp: self.stories.write(tmp, tok), spec)
        self.shard_dir = folder

    def _require_meta(self) -> dict[str, Any]:
        if self.meta is None:
            self.prepare_data()  # idempotent: reuses the cached shards
        assert self.meta is not None
        return self.meta

    def setup(self, stage: str | None = None) -> None:
        """Open the shards (preparing them first if needed) and build the train/validation block datasets."""
        meta = self._require_meta()
        assert self.shard_dir is not None
        for split in ("train", "validation"):
            if not meta["splits"][split]["stories"]:
                raise DataUnavailableError(f"{self.stories.empty(split)}: no {split} stories found (empty stories "
                                           f"list or file)")
        try:
            self.train_set = RandomBlocks(self.shard_dir / "train.bin", self.block_size,
                                          self.train_batches_per_epoch * self.batch_size, self.seed)
            self.val_set = FixedBlocks(self.shard_dir / "val.bin", self.block_size, self.val_batches * self.batch_size)
        except DataConfigError as e:
            raise DataConfigError(f"block_size {self.block_size} is too long for the data: {e}; lower "
                                  f"--model.block_size (python -m training.fit) / data.block_size, or use more "
                                  f"data") from None

    def _loader(self, dataset: Any, sampler: Any = None, cls: type[DataLoader] = DataLoader) -> DataLoader:
        if self.num_workers > 0:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warning from the tokenizers library
        return cls(dataset, batch_size=self.batch_size, sampler=sampler, shuffle=False, num_workers=self.num_workers,
                   pin_memory=torch.cuda.is_available(), persistent_workers=self.num_workers > 0, drop_last=False)

    def train_dataloader(self) -> ResumableDataLoader:
        """``train_batches_per_epoch`` batches of random blocks, fresh ones each epoch; yields ``(x, y)`` (B, T).

        The loader is resumable (Lightning's stateful-dataloader protocol, see
        :class:`~data.sampler.ResumableDataLoader`): a checkpoint stores how far into the epoch training got and a
        resumed run continues with exactly the batches the uninterrupted run would have seen. With several devices
        the sampler splits each epoch's draws between the ranks itself (an :class:`~data.sampler.EpochSampler` is a
        ``DistributedSampler``, so Lightning does not wrap it).
        """
        if self.train_set is None:
            self.setup("fit")
        assert self.train_set is not None
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = EpochSampler(len(self.train_set), num_replicas=world, rank=rank)
        return self._loader(self.train_set, sampler, cls=ResumableDataLoader)  # type: ignore[return-value]

    def val_dataloader(self) -> DataLoader:
        """``val_batches`` batches of fixed, evenly spaced validation blocks; yields ``(x, y)`` (B, T)."""
        if self.val_set is None:
            self.setup("validate")
        assert self.val_set is not None
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        """Same blocks as :meth:`val_dataloader`."""
        return self.val_dataloader()

    def describe(self) -> str:
        """One line describing the data (after setup): source, tokens, vocab, unigram entropy."""
        meta = self._require_meta()
        sp = meta["splits"]
        return (
            f"{self.source} data ({self.shard_dir}): {sp['train']['tokens']:,} train / {sp['validation']['tokens']:,} "
            f"val tokens, {sp['train']['stories']:,} train stories, vocab {meta['tokenizer']['vocab_size']} "
            f"({meta['tokenizer']['name']}), unigram entropy {meta['unigram_entropy']:.3f} nats"
        )
