"""The settings of :class:`data.TinyStoriesDataModule`, checked when it is made: each bad value or clashing pair is
one :class:`~data.errors.DataConfigError` line naming the ``data.`` option, before any file, tokenizer or network."""

from __future__ import annotations

from data.errors import DataConfigError

__all__ = ["check_settings"]


HIGH = {"num_workers": 256, "seed": 2**32 - 1, "synthetic_vocab_size": 65536}
"""Upper bounds of the integer settings (others: 2^30): more loader processes than any machine runs, numpy's seed
range, the uint16 shards' vocabulary; a count beyond 2^30 is a typo, not a setting."""


def check_settings(*, path: str | None, val_path: str | None, tokenizer_path: str | None, synthetic: bool,
                   synthetic_stories: int, synthetic_vocab_size: int, bpe_vocab_size: int | None, block_size: int,
                   batch_size: int, num_workers: int, val_fraction: float, train_batches_per_epoch: int,
                   val_batches: int, seed: int) -> None:
    """Raise :class:`~data.errors.DataConfigError` for the first bad setting (the DataModule's arguments)."""
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
        high = HIGH.get(name, 1 << 30)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            hint = " (kvsplice train sets it from --model.block_size)" if name == "block_size" else ""
            if name == "synthetic_vocab_size":
                hint = " (256 bytes + <|endoftext|> + at least one merge)"
            raise DataConfigError(f"data.{name} must be an integer >= {low}, got {value!r}{hint}")
        if value > high:
            raise DataConfigError(f"data.{name} must be at most {high:,}, got {value!r}")
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
