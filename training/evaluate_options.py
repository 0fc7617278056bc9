"""The options of a ``kvsplice evaluate`` run as one typed object: the declaration of its command line too (each
field's flag, help and parser: :mod:`kvsplice.io.options`), checked when made and passed down instead of the
parser's namespace (:func:`training.evaluate.evaluate_checkpoint` takes it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from kvsplice.io.options import check_counts, count, opt
from kvsplice.io.run_options import DeviceOption, ForceOption

__all__ = ["EvaluateOptions"]


def _bool(value: str) -> bool:
    """argparse type: ``true`` / ``false`` (also 1/0, yes/no, on/off)."""
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EvaluateOptions(ForceOption, DeviceOption):
    """What ``evaluate`` measures of each ``ckpt``: the validation loss over ``tokens`` (``batch_size`` blocks of the
    data the checkpoint was trained with, or the ``data_*`` overrides), the cache bytes (``cache_tokens`` decoded, at
    ``dtype``, scaled to ``context``), decode speed (``prompt_len``, ``decode_tokens``, ``repeats``), samples
    (``sample_tokens``, ``seed``) on ``device`` (None: CUDA when available), and with ``cache_quant`` the loss
    through that cache. The fields declare the command line, in this order."""

    ckpt: tuple[str, ...] = opt(repeat=True, help="checkpoint file (repeat for a comparison)")
    tokens: int = count(16384, help="validation tokens to average the loss over")
    batch_size: int = count(8, help="validation batch size")
    dtype: str = opt("fp32", choices=("fp32", "fp16", "bf16"), help="cache dtype for byte counts")
    context: int = count(1024, help="context length for the cache-bytes column")
    cache_tokens: int = count(64, help="tokens prefilled+decoded to measure the cache")
    prompt_len: int = count(16, help="prompt tokens before timing decode")
    decode_tokens: int = count(64, help="decoded tokens per timing run")
    repeats: int = count(3, help="timing repeats (median reported)")
    sample_tokens: int = count(48, lo=0, help="tokens generated per sample prompt")
    seed: int = opt(1234, help="seed of the samples' generation")
    data_path: Optional[str] = opt(None, flags=("--data.path",), help="override the validation text")
    data_tokenizer_path: Optional[str] = opt(None, flags=("--data.tokenizer_path",), help="override the tokenizer "
                                             "of the validation text")
    data_synthetic: Optional[bool] = opt(None, flags=("--data.synthetic",), parse=_bool, help="true: the embedded "
                                         "offline stories")
    data_cache_dir: Optional[str] = opt(None, flags=("--data.cache_dir",), help="override the data's cache folder")
    cache_quant: Optional[str] = opt(None, choices=("int8",), help="also report the validation loss with every token "
                                     "attending over an int8 cache (and over the unquantised cache, for the same "
                                     "tokens)")
    cache_chunk: int = count(64, help="tokens appended per call for --cache-quant")
    json: Optional[str] = opt(None, help="write all results (and plots next to it)")

    def __post_init__(self) -> None:
        """The counts within their bounds (one line naming the option), before any checkpoint is read."""
        check_counts(self)

    def torch_device(self) -> str:
        """``device``, else ``cuda`` when available, else ``cpu``."""
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
