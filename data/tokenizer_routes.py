"""Which tokenizer a DataModule uses, by route: a given BPE folder / file (``tokenizer_path``); a byte-level BPE trained
on the synthetic stories; a byte-level BPE trained on the local training files (``bpe_vocab_size``); else GPT-2 from
the Hub. Trained tokenizers are cached under ``cache_dir/tokenizers``, keyed by what they were trained on."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from data import stories as story_gen
from data.errors import DataUnavailableError
from data.sources import file_fingerprint, iter_stories_from_file
from data.story_sources import HubStories, LocalStories, StorySource, SyntheticStories
from data.tokenizer import TextTokenizer, load_bpe_tokenizer, load_gpt2_from_hub, train_bpe_tokenizer

__all__ = ["SYNTHETIC_TOKENIZER_STORIES", "cache_key", "check_cache_dir", "pick_tokenizer"]

#: Synthetic stories the synthetic tokenizer is trained on (a prefix of the training stories).
SYNTHETIC_TOKENIZER_STORIES = 4000


def cache_key(obj: object) -> str:
    """Short stable hash of a JSON-friendly object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def check_cache_dir(d: Path) -> None:
    """``cache_dir`` must be (or become) a writable folder: one clear error instead of an OSError later."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataUnavailableError(f"data.cache_dir={str(d)!r} cannot be created ({e.strerror or type(e).__name__}"
                                   f"): set --data.cache_dir to a writable folder") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise DataUnavailableError(f"data.cache_dir={str(d)!r} is not writable: set --data.cache_dir to a "
                                   f"writable folder")


def _cached_bpe(cache_dir: Path, kind: str, vocab_size: int, spec: dict[str, Any],
                texts: Callable[[], Iterable[str]]) -> TextTokenizer:
    """A byte-level BPE of ``vocab_size`` named ``<kind>-bpe-<N>``, loaded from ``cache_dir/tokenizers`` when a
    file for ``spec`` exists, else trained on ``texts()`` and saved there."""
    file = cache_dir / "tokenizers" / f"{kind}-bpe{vocab_size}-{cache_key(spec)}.json"
    if file.is_file():
        tok = load_bpe_tokenizer(file)
    else:
        tok = train_bpe_tokenizer(texts(), vocab_size=vocab_size)
        tok.save(file)
    tok.name = f"{kind}-bpe-{vocab_size}"
    return tok


def _synthetic_bpe(source: SyntheticStories, vocab_size: int, cache_dir: Path) -> TextTokenizer:
    """Byte-level BPE trained on the first (up to) ``SYNTHETIC_TOKENIZER_STORIES`` synthetic training stories (a
    prefix of the training stories; more give the same vocabulary: the generator's word set is small)."""
    n_fit = min(source.stories, SYNTHETIC_TOKENIZER_STORIES)
    spec = {"generator": story_gen.GENERATOR_VERSION, "seed": source.seed, "stories": n_fit, "vocab_size": vocab_size}
    return _cached_bpe(cache_dir, "synthetic", vocab_size, spec,
                       lambda: story_gen.generate_stories(n_fit, source.seed, "train"))


def _local_bpe(source: LocalStories, vocab_size: int, cache_dir: Path) -> TextTokenizer:
    """Byte-level BPE of ``vocab_size`` entries trained on the training files' stories, cached keyed by the files'
    fingerprints (path, size, mtime) and the size."""
    train, _ = source.files()
    spec = {"train": [file_fingerprint(f) for f in train], "vocab_size": vocab_size}
    return _cached_bpe(cache_dir, "local", vocab_size, spec,
                       lambda: (story for f in train for story in iter_stories_from_file(f)))


def pick_tokenizer(source: StorySource, *, tokenizer_path: str | None, synthetic_vocab_size: int,
                   bpe_vocab_size: int | None, cache_dir: Path) -> TextTokenizer:
    """The tokenizer of ``source`` by the first route that applies (see the module docstring).

    Raises:
        DataUnavailableError: it needs the Hub and the Hub is unreachable (or files are missing); for a Hub source
            the error names the dataset (the bigger problem) first.
    """
    source.check()  # missing, empty or garbage data is named before any tokenizer problem
    check_cache_dir(cache_dir)
    if tokenizer_path:
        return load_bpe_tokenizer(tokenizer_path)
    if isinstance(source, SyntheticStories):
        return _synthetic_bpe(source, synthetic_vocab_size, cache_dir)
    if bpe_vocab_size is not None and isinstance(source, LocalStories):
        return _local_bpe(source, bpe_vocab_size, cache_dir)
    try:
        return load_gpt2_from_hub(cache_dir)
    except DataUnavailableError as e:
        if isinstance(source, HubStories):  # the dataset is the bigger problem: name data.path first
            raise source.unavailable(e.reason or str(e)) from None
        raise
