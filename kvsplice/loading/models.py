"""One model and its tokenizer (:func:`load_model`), by what ``spec`` is:

* a directory with ``config.json`` → ``transformers.AutoModelForCausalLM.from_pretrained`` + ``AutoTokenizer``
  (the families of :data:`kvsplice.adapters.SUPPORTED_FAMILIES`: GPT-2, Llama, Mistral, Qwen2/3, Phi-3, Gemma-3;
  anything else fails with :func:`kvsplice.adapters.model_info`'s one-line "unsupported" error naming them).
  ``kvsplice convert-llama2c`` makes such a directory from a llama2.c checkpoint (e.g. stories260K);
* a directory whose ``config.json`` has ``model_type: kvsplice_mla_llama`` → a converted Llama-family MLA model
  (:mod:`kvsplice.loading.mla_folder`, made by ``kvsplice to-mla``) and the tokenizer saved beside it;
* a file (``.ckpt``) → this project's MHA GPT via ``models.checkpoint.load_gpt_checkpoint``; its tokenizer is the one its
  training data used (rebuilt from the checkpoint's data settings with :class:`data.TinyStoriesDataModule`), or
  ``tokenizer=`` (a GPT-2 BPE folder / ``tokenizer.json``, or an HF tokenizer directory);
* a ``.gguf`` file, or a folder holding one and no ``config.json`` → :mod:`kvsplice.loading.gguf` (dequantised to fp32,
  a plain transformers model; needs the ``gguf`` package);
* anything else → a Hugging Face Hub id (the local HF cache first; offline this fails with one line saying to pass
  a local directory).

Every failure is a :class:`~kvsplice.loading.errors.LoadError` with a one-line message, for the CLIs to print.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from kvsplice.io.cli import first_line
from kvsplice.loading.errors import LoadError
from kvsplice.loading.tokenizers import Tokenizer, checkpoint_tokenizer, from_hf_tokenizer, load_tokenizer

__all__ = ["LoadedModel", "load_model"]

CONVERT_HINT = ("pass a local model directory instead, e.g. one made by `kvsplice convert-llama2c "
                "MODEL.bin --tokenizer TOK.bin --out DIR` or saved with save_pretrained()")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    kind: str  # "hf-dir" | "hub" | "ckpt" | "gguf" | "mla" (a converted MLA folder)
    source: str
    max_positions: Optional[int]

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "class": type(self.model).__name__,
                "max_positions": self.max_positions, "tokenizer": self.tokenizer.describe()}


def _max_positions(model: nn.Module) -> Optional[int]:
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, key, None)
        if isinstance(v, int):
            return v
    ours = getattr(model, "cfg", None)
    return getattr(ours, "block_size", None)


def _check_supported(model: nn.Module) -> None:
    from kvsplice.adapters import model_info

    try:
        model_info(model)
    except ValueError as e:
        raise LoadError(first_line(e)) from None


def _check_weights(model: nn.Module, source: str) -> None:
    """Every weight of a loaded transformers model is a finite floating-point tensor (a training ``.ckpt`` is
    checked tensor by tensor against its config by :func:`models.checkpoint.load_gpt_checkpoint`)."""
    from models.checkpoint import check_tensor

    for name, p in model.named_parameters():
        try:
            check_tensor(p.detach(), source, name)
        except ValueError as e:
            raise LoadError(str(e)) from None


def _load_hf(name: str, *, local_only: bool, tokenizer: Optional[str], dtype: Optional[torch.dtype]):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvsplice.loading.gguf import refuse_incomplete

    kw: dict[str, Any] = {"local_files_only": local_only, "trust_remote_code": False}  # never run or ask about a
    # repository's own code (transformers would otherwise stop at an interactive [y/N] prompt)
    if dtype is not None:
        kw["dtype"] = dtype
    kw["ignore_mismatched_sizes"] = True  # wrongly shaped weights (a hand-edited config.json) are listed in `info`
    # and refused below in one line, not raised after transformers' multi-line load report
    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar: the CLIs' stderr stays one error line
    hf_logging.set_verbosity_error()  # nor the load report (missing / unexpected / mismatched weights: `info`)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(name, output_loading_info=True, **kw)
        model.eval()
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    try:
        refuse_incomplete(info, name)  # weights transformers would initialise at random
    except ValueError as e:
        raise LoadError(str(e)) from None
    _check_supported(model)
    _check_weights(model, name)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        try:
            tok = from_hf_tokenizer(AutoTokenizer.from_pretrained(name, local_files_only=local_only,
                                                                   trust_remote_code=False), name)
        except Exception as e:  # noqa: BLE001
            raise LoadError(f"{name}: the model loaded but its tokenizer did not ({first_line(e)}); pass "
                            f"--tokenizer") from None
    return model, tok


def _load_gguf(p: Path, *, tokenizer: Optional[str], dtype: Optional[torch.dtype]):
    from kvsplice.loading.gguf import load_gguf

    try:
        model, hf_tok = load_gguf(p, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - a missing gguf package, a corrupt or unsupported file
        raise LoadError(f"cannot load the GGUF model {p}: {first_line(e)}") from None
    _check_supported(model)
    _check_weights(model, str(p))
    tok = load_tokenizer(tokenizer) if tokenizer is not None else from_hf_tokenizer(hf_tok, str(p))
    return model, tok


def _load_mla(p: Path, *, tokenizer: Optional[str], dtype: Optional[torch.dtype]):
    from kvsplice.loading.mla_folder import load_mla_folder

    try:
        model = load_mla_folder(p, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - a corrupt folder: missing or mismatched weights, bad config
        raise LoadError(f"cannot load the converted MLA model in {p}: {first_line(e)}") from None
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # AutoTokenizer reads config.json and warns about the unknown model_type
    try:
        return model, load_tokenizer(tokenizer if tokenizer is not None else p)
    finally:
        hf_logging.set_verbosity(level)


def _refuse_remote_code(folder: Path) -> None:
    """A model folder whose ``config.json`` maps to its own Python code (``auto_map``, e.g. a ``training.export`` of
    an MLA model) is refused with one line: the tools never run a repository's code."""
    import json

    try:
        auto_map = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("auto_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise LoadError(f"{folder}/config.json is not a JSON object ({first_line(e)})") from None
    if auto_map:
        raise LoadError(f"{folder} holds custom model code (config.json auto_map), which the kvsplice tools do not "
                        f"run; pass the training .ckpt it was exported from, or load it yourself with "
                        f"AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)")


def load_model(spec: str | os.PathLike, *, tokenizer: Optional[str] = None, dtype: Optional[torch.dtype] = None,
               device: str | torch.device = "cpu") -> LoadedModel:
    """Load ``spec`` (a model directory, a ``.ckpt`` file or a Hub id; see the module docstring) in eval mode."""
    spec = str(spec)
    p = Path(spec).expanduser()
    from kvsplice.loading.checks import check_source
    from kvsplice.loading.gguf import find_gguf, gguf_files

    check_source(p)  # config values against the weights' headers, before any model is built

    if find_gguf(p) is not None:  # a .gguf file (or a folder holding one): kvsplice.loading.gguf
        model, tok = _load_gguf(p, tokenizer=tokenizer, dtype=dtype)
        kind = "gguf"
    elif p.is_dir():
        several = gguf_files(p)
        if not (p / "config.json").is_file() and len(several) > 1:
            raise LoadError(f"{spec} holds {len(several)} GGUF files ({', '.join(f.name for f in several[:3])}"
                            f"{', ...' if len(several) > 3 else ''}): pass the one to load, e.g. --model "
                            f"{several[0]}")
        if not (p / "config.json").is_file():
            raise LoadError(f"{spec} is a directory without config.json: not a transformers model directory "
                            f"(e.g. make one with kvsplice convert-llama2c)")
        _refuse_remote_code(p)
        from kvsplice.loading.mla_folder import is_mla_folder
        from kvsplice.loading.deepseek_folder import is_deepseek_v3_folder, load_deepseek_v3

        if is_mla_folder(p):  # a converted Llama-family MLA model (kvsplice to-mla)
            model, tok = _load_mla(p, tokenizer=tokenizer, dtype=dtype)
            kind = "mla"
        elif is_deepseek_v3_folder(p):  # our DeepSeek-V3 exports, read back into our models (deepseek_folder)
            (model, tok), kind = load_deepseek_v3(p, tokenizer=tokenizer, dtype=dtype), "mla"
        else:
            try:
                model, tok = _load_hf(str(p), local_only=True, tokenizer=tokenizer, dtype=dtype)
            except LoadError:
                raise
            except Exception as e:  # noqa: BLE001 - unknown model types, corrupt weights, ...
                raise LoadError(f"cannot load the model in {spec}: {first_line(e)}") from None
            kind = "hf-dir"
    elif p.is_file():
        from models.checkpoint import CheckpointError, load_gpt_checkpoint

        try:
            model, _, meta = load_gpt_checkpoint(p)
        except CheckpointError as e:
            raise LoadError(first_line(e)) from None
        _check_supported(model)
        tok = load_tokenizer(tokenizer) if tokenizer is not None else checkpoint_tokenizer(meta, p)
        if dtype is not None:
            model = model.to(dtype)
        kind = "ckpt"
    else:
        looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith((".ckpt", ".pt", ".bin", ".safetensors")) \
            or spec.count("/") > 1 or os.sep != "/" and os.sep in spec
        if looks_like_path:
            raise LoadError(f"model not found: {spec} (expected a model directory with config.json, a .ckpt "
                            f"checkpoint or a Hugging Face Hub id)")
        model = None
        try:  # the local HF cache first: works offline when the model was downloaded before
            model, tok = _load_hf(spec, local_only=True, tokenizer=tokenizer, dtype=dtype)
        except LoadError:
            raise
        except Exception:  # noqa: BLE001
            pass
        if model is None:
            from data.errors import hub_offline_reason

            reason = hub_offline_reason()
            if reason is not None:
                raise LoadError(f"cannot download {spec!r} from the Hugging Face Hub ({reason}) and it is not a "
                                f"local path; {CONVERT_HINT}")
            try:
                model, tok = _load_hf(spec, local_only=False, tokenizer=tokenizer, dtype=dtype)
            except LoadError:
                raise
            except Exception as e:  # noqa: BLE001
                raise LoadError(f"cannot load {spec!r} from the Hugging Face Hub ({first_line(e, 200)}); "
                                f"{CONVERT_HINT}") from None
        kind = "hub"
    model = model.to(device).eval()
    if tok.vocab_size > _vocab(model):
        raise LoadError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary has only "
                        f"{_vocab(model)}: wrong --tokenizer?")
    return LoadedModel(model, tok, kind, spec, _max_positions(model))


def _vocab(model: nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.transformer.wte
    return int(emb.weight.shape[0])
