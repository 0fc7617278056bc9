"""The DeepSeek-V3 exporter: any model of the package with MLA as a folder that plain ``transformers``
(``AutoModelForCausalLM.from_pretrained``, no remote code), vLLM, SGLang and — through ``kvsplice to-gguf`` —
llama.cpp load as MLA (``model_type: deepseek_v3``, dense MLPs, no q-LoRA, untied ``lm_head``,
``rope_interleave: true``).

| source family | writer | command |
|---|---|---|
| converted Llama-family model (:class:`models.mla_llama.MLALlama`, shared RoPE) | :mod:`kvsplice.convert.deepseek_v3_llama` | ``kvsplice to-mla --format deepseek_v3`` |
| trained ``layout="deepseek_v3"`` :class:`models.GPT`, MLA / MLA + KVSplice | :mod:`kvsplice.convert.deepseek_v3_gpt` | ``kvsplice export --format deepseek_v3`` |

Each family registers one writer (:func:`kvsplice.convert.deepseek_v3_writer.register`), which says what is its own;
the assembly every family shares — the mapping onto DeepSeek-V3's projections, the exact padding of the cache row
(``pad_latent`` / ``pad_rope``: :mod:`kvsplice.convert.latent_pad`; ``--pad-latent 512 --pad-rope 64`` is the one row
vLLM's CPU MLA kernel takes), the ``config.json`` and the files — is written once in
:mod:`kvsplice.convert.deepseek_v3_writer`. A model no writer takes, or one its writer refuses, is one
``ValueError`` line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from kvsplice.convert import deepseek_v3_gpt, deepseek_v3_llama  # noqa: F401  (each registers its writer)
from kvsplice.convert.deepseek_v3_llama import LINEAR_EPS, LINEAR_RHO, linear_regime
from kvsplice.convert.deepseek_v3_writer import (WRITERS, DeepSeekV3Writer, dense_mla_config, interleave_index,
                                                 portable_tokenizer_config)

__all__ = ["LINEAR_EPS", "LINEAR_RHO", "check_exportable", "check_pad", "deepseek_v3_config", "deepseek_v3_state_dict",
           "dense_mla_config", "interleave_index", "linear_regime", "portable_tokenizer_config", "save_deepseek_v3",
           "writer_for"]


def writer_for(model: Any) -> DeepSeekV3Writer:
    """The registered writer of ``model``'s family (ValueError, one line, when none takes it)."""
    for cls in WRITERS:
        if cls.accepts(model):
            return cls(model)
    families = ", ".join(cls.family for cls in WRITERS)
    raise ValueError(f"--format deepseek_v3 exports a {families}; got a {type(model).__name__}")


def check_exportable(model: Any) -> None:
    """Raise ``ValueError`` (one line) unless ``model`` maps onto DeepSeek-V3 exactly."""
    writer_for(model).check()


def check_pad(model: Any, pad_latent: Optional[int], pad_rope: Optional[int] = None) -> tuple[int, int]:
    """The exported ``(kv_lora_rank, qk_rope_head_dim)``: the model's, or ``pad_latent`` / ``pad_rope`` (padded
    exactly, so that an engine that takes only some row sizes runs the model: vLLM's MLA takes latent + RoPE of 320 /
    512 / 576, its CPU kernel 512 + 64). ValueError (one line) for a size smaller than the model's, beyond the bounds
    of :mod:`kvsplice.convert.latent_pad` or a RoPE size that is not a multiple of the model's."""
    return writer_for(model).padded(pad_latent, pad_rope)


def deepseek_v3_config(model: Any, pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> dict[str, Any]:
    """The export's ``config.json``."""
    return writer_for(model).config(pad_latent, pad_rope)


def deepseek_v3_state_dict(model: Any, pad_latent: Optional[int] = None,
                           pad_rope: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The export's weights (transformers' DeepSeek-V3 names)."""
    return writer_for(model).state_dict(pad_latent, pad_rope)


def save_deepseek_v3(model: Any, folder: Path, tokenizer: Optional[Any] = None, pad_latent: Optional[int] = None,
                     pad_rope: Optional[int] = None) -> None:
    """Write the export (weights, config and — given — the tokenizer) into ``folder`` (a fresh temporary folder of
    :func:`kvsplice.io.folders.write_dir`)."""
    writer_for(model).save(folder, tokenizer, pad_latent, pad_rope)
