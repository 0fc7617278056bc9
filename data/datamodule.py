"""LightningDataModule for TinyStories (Hugging Face Hub or local files) and the embedded offline synthetic stories.

Pipeline: stories -> tokenizer -> ``uint16`` token shards cached under ``cache_dir`` (once, idempotent) ->
random ``block_size + 1`` token windows for training, a fixed evenly spaced set of windows for validation.
Batches are ``(x, y)`` int64 tensors of shape (B, T) with ``y`` = ``x`` shifted left by one token.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from data import stories as story_gen
from data.errors import OFFLINE_HINT, DataConfigError, DataUnavailableError, hub_offline_reason
from data.shards import (EpochSampler, FixedBlocks, RandomBlocks, ResumableDataLoader, build_shards, split_tail,
                         write_split)
from data.sources import file_fingerprint, is_validation_file, iter_stories_from_file, list_story_files
from data.tokenizer import TextTokenizer, load_gpt2_from_hub, load_bpe_tokenizer, train_bpe_tokenizer

__all__ = ["TinyStoriesDataModule"]

#: Synthetic stories the synthetic tokenizer is trained on (a prefix of the training stories).
SYNTHETIC_TOKENIZER_STORIES = 4000


def _key(obj: object) -> str:
    """Short stable hash of a JSON-friendly object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:40] or "data"


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
        if synthetic and (path or val_path):
            raise DataConfigError("data.synthetic=true and data.path/data.val_path are mutually exclusive")
        for name, value in (("val_fraction", val_fraction),):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
                raise DataConfigError(f"data.{name} must be in (0, 1), got {value!r}")
        for name, value in (
            ("block_size", block_size),
            ("batch_size", batch_size),
            ("synthetic_stories", synthetic_stories),
            ("train_batches_per_epoch", train_batches_per_epoch),
            ("val_batches", val_batches),
            ("num_workers", num_workers),
            ("synthetic_vocab_size", synthetic_vocab_size),
            ("seed", seed),
        ):
            low = {"num_workers": 0, "seed": 0, "synthetic_vocab_size": 258}.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                hint = " (python -m training.fit sets it from --model.block_size)" if name == "block_size" else ""
                if name == "synthetic_vocab_size":
                    hint = " (256 bytes + <|endoftext|> + at least one merge)"
                raise DataConfigError(f"data.{name} must be an integer >= {low}, got {value!r}{hint}")
        if bpe_vocab_size is not None:
            if isinstance(bpe_vocab_size, bool) or not isinstance(bpe_vocab_size, int) or not 258 <= bpe_vocab_size \
                    <= 65536:
                raise DataConfigError(f"data.bpe_vocab_size must be an integer in [258, 65536] (256 bytes + "
                                      f"<|endoftext|> + merges; uint16 shards), got {bpe_vocab_size!r}")
            if not path:
                raise DataConfigError("data.bpe_vocab_size trains a tokenizer on local files: set data.path too (the "
                                      "synthetic stories have data.synthetic_vocab_size; the Hub path uses GPT-2's)")
            if tokenizer_path:
                raise DataConfigError("data.bpe_vocab_size and data.tokenizer_path are mutually exclusive: train a "
                                      "vocabulary or load one")
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

    # ----------------------------------------------------------------------------------------------------------------
    # Tokenizer
    # ----------------------------------------------------------------------------------------------------------------
    @property
    def source(self) -> str:
        """``"synthetic"``, ``"local"`` or ``"hub"``."""
        return "synthetic" if self.synthetic else "local" if self.path else "hub"

    def _hub_unavailable(self, reason: str) -> DataUnavailableError:
        return DataUnavailableError(
            f"TinyStories ({self.dataset!r}) cannot be downloaded ({reason}) and no local copy was given: set "
            f"--data.path (data.path) to TinyStories .txt/.json files (and --data.tokenizer_path to GPT-2's "
            f"vocab/merges files), {OFFLINE_HINT}",
            reason=reason,
        )

    @property
    def tokenizer(self) -> TextTokenizer:
        """The tokenizer (``encode``, ``decode``, ``eot_id``, ``vocab_size``), loaded, downloaded or trained lazily.

        Raises:
            DataUnavailableError: it needs the Hub and the Hub is unreachable (or files are missing).
        """
        if self._tokenizer is None:
            if self.path:
                self._local_files()  # missing, empty or garbage data is named before any tokenizer problem
            self._check_cache_dir()
            if self.tokenizer_path:
                self._tokenizer = load_bpe_tokenizer(self.tokenizer_path)
            elif self.synthetic:
                self._tokenizer = self._synthetic_tokenizer()
            elif self.bpe_vocab_size is not None:
                self._tokenizer = self._local_bpe_tokenizer()
            else:
                try:
                    self._tokenizer = load_gpt2_from_hub(self.cache_dir)
                except DataUnavailableError as e:
                    if self.source == "hub":  # the dataset is the bigger problem: name data.path first
                        raise self._hub_unavailable(e.reason or str(e)) from None
                    raise
        return self._tokenizer

    def _check_cache_dir(self) -> None:
        """``cache_dir`` must be (or become) a writable folder: one clear error instead of an OSError later."""
        d = self.cache_dir
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataUnavailableError(f"data.cache_dir={str(d)!r} cannot be created ({e.strerror or type(e).__name__}"
                                       f"): set --data.cache_dir to a writable folder") from None
        if not os.access(d, os.W_OK | os.X_OK):
            raise DataUnavailableError(f"data.cache_dir={str(d)!r} is not writable: set --data.cache_dir to a "
                                       f"writable folder")

    def _cached_bpe(self, kind: str, vocab_size: int, spec: dict[str, Any],
                    texts: Callable[[], Iterable[str]]) -> TextTokenizer:
        """A byte-level BPE of ``vocab_size`` named ``<kind>-bpe-<N>``, loaded from ``cache_dir/tokenizers`` when a
        file for ``spec`` exists, else trained on ``texts()`` and saved there."""
        file = self.cache_dir / "tokenizers" / f"{kind}-bpe{vocab_size}-{_key(spec)}.json"
        if file.is_file():
            tok = load_bpe_tokenizer(file)
        else:
            tok = train_bpe_tokenizer(texts(), vocab_size=vocab_size)
            tok.save(file)
        tok.name = f"{kind}-bpe-{vocab_size}"
        return tok

    def _synthetic_tokenizer(self) -> TextTokenizer:
        """Byte-level BPE trained on the first (up to) ``SYNTHETIC_TOKENIZER_STORIES`` synthetic training stories (a
        prefix of the training stories; more give the same vocabulary: the generator's word set is small)."""
        n_fit = min(self.synthetic_stories, SYNTHETIC_TOKENIZER_STORIES)
        spec = {"generator": story_gen.GENERATOR_VERSION, "seed": self.seed, "stories": n_fit,
                "vocab_size": self.synthetic_vocab_size}
        return self._cached_bpe("synthetic", self.synthetic_vocab_size, spec,
                                lambda: story_gen.generate_stories(n_fit, self.seed, "train"))

    def _local_bpe_tokenizer(self) -> TextTokenizer:
        """Byte-level BPE of ``bpe_vocab_size`` entries trained on the training files' stories, cached keyed by the
        files' fingerprints (path, size, mtime) and the size."""
        train, _ = self._local_files()
        spec = {"train": [file_fingerprint(f) for f in train], "vocab_size": self.bpe_vocab_size}
        return self._cached_bpe("local", self.bpe_vocab_size, spec,
                                lambda: (story for f in train for story in iter_stories_from_file(f)))

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

    # ----------------------------------------------------------------------------------------------------------------
    # Shards
    # ----------------------------------------------------------------------------------------------------------------
    def _local_files(self) -> tuple[list[Path], list[Path]]:
        """(train files, validation files); validation may be empty (then a tail is held out)."""
        files = list_story_files(self.path, "data.path")  # type: ignore[arg-type]
        if self.val_path:
            return files, list_story_files(self.val_path, "data.val_path")
        val = [f for f in files if is_validation_file(f)]
        train = [f for f in files if not is_validation_file(f)]
        if not train:  # only validation-looking files: use them for training and hold out a tail
            return files, []
        return train, val

    def _shard_spec(self) -> tuple[str, dict[str, Any]]:
        """(folder name prefix, JSON description of the source) that keys the shard cache."""
        if self.path:
            self._local_files()  # a missing/empty data.path is reported before any tokenizer problem
        common = {"tokenizer": self.tokenizer.fingerprint}
        if self.synthetic:
            spec = {
                "kind": "synthetic",
                "generator": story_gen.GENERATOR_VERSION,
                "seed": self.seed,
                "stories": self.synthetic_stories,
                "val_stories": self._synthetic_val_count(),
            }
            return f"synthetic-s{self.seed}-n{self.synthetic_stories}", {**spec, **common}
        if self.path:
            train, val = self._local_files()
            spec = {
                "kind": "local",
                "train": [file_fingerprint(f) for f in train],
                "validation": [file_fingerprint(f) for f in val],
            }
            if not val:
                spec["val_fraction"] = self.val_fraction
            return f"local-{_slug(Path(self.path).name)}", {**spec, **common}
        return f"hub-{_slug(self.dataset)}", {
            "kind": "hub",
            "dataset": self.dataset,
            "val_fraction": self.val_fraction,
            **common,
        }

    def _synthetic_val_count(self) -> int:
        return max(1, round(self.synthetic_stories * self.val_fraction))

    def _write_synthetic(self, tmp: Path) -> dict[str, dict[str, int]]:
        tok = self.tokenizer
        n_val = self._synthetic_val_count()
        return {
            "train": write_split(
                story_gen.iter_stories(self.synthetic_stories, self.seed, "train"),
                tmp / "train.bin",
                tok,
                "tokenizing synthetic train",
                self.synthetic_stories,
            ),
            "validation": write_split(
                story_gen.iter_stories(n_val, self.seed, "validation"),
                tmp / "val.bin",
                tok,
                "tokenizing synthetic val",
                n_val,
            ),
        }

    def _write_local(self, tmp: Path) -> dict[str, dict[str, int]]:
        train, val = self._local_files()
        tok = self.tokenizer

        def stream(files: list[Path]) -> Iterator[str]:
            for f in files:
                yield from iter_stories_from_file(f)

        stats = {"train": write_split(stream(train), tmp / "train.bin", tok, f"tokenizing {self.path}")}
        if not stats["train"]["stories"]:
            raise DataUnavailableError(f"data.path={str(self.path)!r}: no stories found (an empty stories list or "
                                       f"file): give TinyStories .txt/.json/.jsonl text")
        if val:
            stats["validation"] = write_split(stream(val), tmp / "val.bin", tok, "tokenizing validation files")
            if not stats["validation"]["stories"]:
                where = f"data.val_path={str(self.val_path)!r}" if self.val_path else f"validation files {val}"
                raise DataUnavailableError(f"{where}: no stories found (an empty stories list or file)")
        else:
            stats["train"], stats["validation"] = split_tail(
                tmp / "train.bin", tmp / "val.bin", self.val_fraction, tok.eot_id
            )
        return stats

    def _load_hub_dataset(self) -> Any:
        """``datasets.load_dataset(self.dataset)``, failing fast with one clear error when offline."""
        reason = hub_offline_reason()
        import datasets  # slow import: only on this path

        if reason is not None and not getattr(datasets.config, "HF_HUB_OFFLINE", False):
            # Offline and datasets would still try (and retry) the network: fail now.
            raise self._hub_unavailable(reason)
        try:  # online, or datasets' own offline mode (served from its local cache if present)
            return datasets.load_dataset(self.dataset)
        except Exception as e:  # noqa: BLE001 - any hub/network/cache failure becomes one clear error
            msg = str(e).splitlines()[0] if str(e) else ""
            raise self._hub_unavailable(reason or f"{type(e).__name__}: {msg}") from None

    def _write_hub(self, tmp: Path) -> dict[str, dict[str, int]]:
        ds = self._load_hub_dataset()
        tok = self.tokenizer

        def stream(split: Any) -> Iterator[str]:
            column = "text" if "text" in split.column_names else split.column_names[0]
            for batch in split.iter(batch_size=1024):
                for text in batch[column]:
                    if text and (text := text.strip()):
                        yield text

        stats = {
            "train": write_split(
                stream(ds["train"]), tmp / "train.bin", tok, f"tokenizing {self.dataset} train", len(ds["train"])
            )
        }
        val_name = next((s for s in ("validation", "valid", "val", "test") if s in ds), None)
        if val_name is not None:
            stats["validation"] = write_split(
                stream(ds[val_name]), tmp / "val.bin", tok, f"tokenizing {self.dataset} {val_name}", len(ds[val_name])
            )
        else:
            stats["train"], stats["validation"] = split_tail(
                tmp / "train.bin", tmp / "val.bin", self.val_fraction, tok.eot_id
            )
        return stats

    def prepare_data(self) -> None:
        """Tokenise the source into cached ``uint16`` shards (no-op when they already exist).

        Raises:
            DataUnavailableError: data or tokenizer unavailable (offline Hub, missing path, unreadable files).
        """
        prefix, spec = self._shard_spec()
        self._check_cache_dir()
        folder = self.cache_dir / f"{prefix}-{_key(spec)}"
        write = {"synthetic": self._write_synthetic, "local": self._write_local, "hub": self._write_hub}[self.source]
        self.meta = build_shards(folder, self.tokenizer, write, spec)
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
                where = {"synthetic": "the synthetic stories", "hub": f"the Hub dataset {self.dataset!r}"}.get(
                    self.source, f"data.{'val_path' if split == 'validation' and self.val_path else 'path'}="
                                 f"{self.val_path if split == 'validation' and self.val_path else self.path!r}")
                raise DataUnavailableError(f"{where}: no {split} stories found (empty stories list or file)")
        try:
            self.train_set = RandomBlocks(
                self.shard_dir / "train.bin", self.block_size, self.train_batches_per_epoch * self.batch_size,
                self.seed
            )
            self.val_set = FixedBlocks(self.shard_dir / "val.bin", self.block_size, self.val_batches * self.batch_size)
        except DataConfigError as e:
            raise DataConfigError(f"block_size {self.block_size} is too long for the data: {e}; lower "
                                  f"--model.block_size (python -m training.fit) / data.block_size, or use more "
                                  f"data") from None

    # ----------------------------------------------------------------------------------------------------------------
    # Loaders
    # ----------------------------------------------------------------------------------------------------------------
    def _loader(self, dataset: Any, sampler: Any = None, cls: type[DataLoader] = DataLoader) -> DataLoader:
        if self.num_workers > 0:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warning from the tokenizers library
        return cls(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            shuffle=False,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            drop_last=False,
        )

    def train_dataloader(self) -> ResumableDataLoader:
        """``train_batches_per_epoch`` batches of random blocks, fresh ones each epoch; yields ``(x, y)`` (B, T).

        The loader is resumable (Lightning's stateful-dataloader protocol, see
        :class:`~data.shards.ResumableDataLoader`): a checkpoint stores how far into the epoch training got and a
        resumed run continues with exactly the batches the uninterrupted run would have seen. With several devices
        the sampler splits each epoch's draws between the ranks itself (an :class:`~data.shards.EpochSampler` is a
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
