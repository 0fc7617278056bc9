"""Where the training stories come from, one small class per source behind one protocol (:class:`StorySource`):
the embedded offline generator (:class:`SyntheticStories`), local files (:class:`LocalStories`, read with
:mod:`data.sources`) and a Hugging Face Hub dataset (:class:`HubStories`).

A source names itself (``kind``), checks that its stories exist before any tokenizer work (:meth:`~StorySource.check`),
describes itself for the shard cache key (:meth:`~StorySource.shard_spec`) and tokenises its train / validation
stories into ``train.bin`` / ``val.bin`` (:meth:`~StorySource.write`, called by :func:`data.shards.build_shards`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from data import stories as story_gen
from data.errors import OFFLINE_HINT, DataUnavailableError, hub_offline_reason
from data.shards import split_tail, write_split
from data.sources import file_fingerprint, is_validation_file, iter_stories_from_file, list_story_files
from data.tokenizer import TextTokenizer

__all__ = ["HubStories", "LocalStories", "StorySource", "SyntheticStories"]

Stats = dict[str, dict[str, int]]
"""``{"train": stats, "validation": stats}`` of :func:`data.shards.write_split`."""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:40] or "data"


class StorySource(Protocol):
    kind: str  # "synthetic" | "local" | "hub"

    def check(self) -> None:
        """Raise :class:`~data.errors.DataUnavailableError` now if the stories are missing or unreadable."""

    def shard_spec(self) -> tuple[str, dict[str, Any]]:
        """(folder name prefix, JSON description of the stories) that keys the shard cache."""

    def write(self, tmp: Path, tok: TextTokenizer) -> Stats:
        """Tokenise the train / validation stories into ``tmp/train.bin`` and ``tmp/val.bin``."""

    def empty(self, split: str) -> str:
        """Where the stories of ``split`` were looked for, as an error names it."""


@dataclass
class SyntheticStories:
    """The embedded offline story generator: ``stories`` training stories and ``val_fraction`` as many more for
    validation, from independent random streams of ``seed``."""

    stories: int
    seed: int
    val_fraction: float
    kind: str = "synthetic"

    @property
    def val_count(self) -> int:
        return max(1, round(self.stories * self.val_fraction))

    def check(self) -> None:
        pass

    def shard_spec(self) -> tuple[str, dict[str, Any]]:
        spec = {"kind": "synthetic", "generator": story_gen.GENERATOR_VERSION, "seed": self.seed,
                "stories": self.stories, "val_stories": self.val_count}
        return f"synthetic-s{self.seed}-n{self.stories}", spec

    def write(self, tmp: Path, tok: TextTokenizer) -> Stats:
        n_val = self.val_count
        return {
            "train": write_split(story_gen.iter_stories(self.stories, self.seed, "train"), tmp / "train.bin", tok,
                                 "tokenizing synthetic train", self.stories),
            "validation": write_split(story_gen.iter_stories(n_val, self.seed, "validation"), tmp / "val.bin", tok,
                                      "tokenizing synthetic val", n_val),
        }

    def empty(self, split: str) -> str:
        return "the synthetic stories"


@dataclass
class LocalStories:
    """Local ``.txt`` / ``.json`` / ``.jsonl`` files or a folder of them (``path``); validation: ``val_path``, else the
    files named ``val``/``valid``, else a held-out ``val_fraction`` tail of the training tokens."""

    path: str
    val_path: str | None
    val_fraction: float
    kind: str = "local"

    def files(self) -> tuple[list[Path], list[Path]]:
        """(train files, validation files); validation may be empty (then a tail is held out)."""
        files = list_story_files(self.path, "data.path")
        if self.val_path:
            return files, list_story_files(self.val_path, "data.val_path")
        val = [f for f in files if is_validation_file(f)]
        train = [f for f in files if not is_validation_file(f)]
        if not train:  # only validation-looking files: use them for training and hold out a tail
            return files, []
        return train, val

    def check(self) -> None:
        self.files()

    def shard_spec(self) -> tuple[str, dict[str, Any]]:
        train, val = self.files()
        spec: dict[str, Any] = {"kind": "local", "train": [file_fingerprint(f) for f in train],
                                "validation": [file_fingerprint(f) for f in val]}
        if not val:
            spec["val_fraction"] = self.val_fraction
        return f"local-{_slug(Path(self.path).name)}", spec

    def write(self, tmp: Path, tok: TextTokenizer) -> Stats:
        train, val = self.files()

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
            stats["train"], stats["validation"] = split_tail(tmp / "train.bin", tmp / "val.bin", self.val_fraction,
                                                             tok.eot_id)
        return stats

    def empty(self, split: str) -> str:
        own = split == "validation" and self.val_path
        return f"data.{'val_path' if own else 'path'}={self.val_path if own else self.path!r}"


@dataclass
class HubStories:
    """A Hugging Face Hub dataset (``text`` column; its ``validation`` split, else a held-out ``val_fraction``)."""

    dataset: str
    val_fraction: float
    kind: str = "hub"

    def unavailable(self, reason: str) -> DataUnavailableError:
        return DataUnavailableError(
            f"TinyStories ({self.dataset!r}) cannot be downloaded ({reason}) and no local copy was given: set "
            f"--data.path (data.path) to TinyStories .txt/.json files (and --data.tokenizer_path to GPT-2's "
            f"vocab/merges files), {OFFLINE_HINT}",
            reason=reason,
        )

    def check(self) -> None:
        pass

    def shard_spec(self) -> tuple[str, dict[str, Any]]:
        return f"hub-{_slug(self.dataset)}", {"kind": "hub", "dataset": self.dataset, "val_fraction": self.val_fraction}

    def load(self) -> Any:
        """``datasets.load_dataset(self.dataset)``, failing fast with one clear error when offline."""
        reason = hub_offline_reason()
        import datasets  # slow import: only on this path

        if reason is not None and not getattr(datasets.config, "HF_HUB_OFFLINE", False):
            # Offline and datasets would still try (and retry) the network: fail now.
            raise self.unavailable(reason)
        try:  # online, or datasets' own offline mode (served from its local cache if present)
            return datasets.load_dataset(self.dataset)
        except Exception as e:  # noqa: BLE001 - any hub/network/cache failure becomes one clear error
            msg = str(e).splitlines()[0] if str(e) else ""
            raise self.unavailable(reason or f"{type(e).__name__}: {msg}") from None

    def write(self, tmp: Path, tok: TextTokenizer) -> Stats:
        ds = self.load()

        def stream(split: Any) -> Iterator[str]:
            column = "text" if "text" in split.column_names else split.column_names[0]
            for batch in split.iter(batch_size=1024):
                for text in batch[column]:
                    if text and (text := text.strip()):
                        yield text

        stats = {"train": write_split(stream(ds["train"]), tmp / "train.bin", tok,
                                      f"tokenizing {self.dataset} train", len(ds["train"]))}
        val_name = next((s for s in ("validation", "valid", "val", "test") if s in ds), None)
        if val_name is not None:
            stats["validation"] = write_split(stream(ds[val_name]), tmp / "val.bin", tok,
                                              f"tokenizing {self.dataset} {val_name}", len(ds[val_name]))
        else:
            stats["train"], stats["validation"] = split_tail(tmp / "train.bin", tmp / "val.bin", self.val_fraction,
                                                             tok.eot_id)
        return stats

    def empty(self, split: str) -> str:
        return f"the Hub dataset {self.dataset!r}"
