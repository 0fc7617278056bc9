"""The DeepSeek-V3 exporter's shared half: what every source family writes the same way, and the registry of the
writers, one per source family (as llama.cpp's ``convert_hf_to_gguf.py`` registers one class per architecture).

A writer (:class:`DeepSeekV3Writer`, registered with :func:`register`) says only what is its family's own: whether it
takes a model, its one-line refusals, its cache row (latent ``r``, RoPE ``Dr``), its ``config.json`` fields, and
per layer an :class:`MLALayer` — the projections in DeepSeek-V3's terms. This module assembles them, per layer (``H``
query heads of ``D``, cached latent ``r`` padded to ``P``, RoPE ``Dr`` padded to ``Dr'``):

* ``q_proj`` (``q_lora_rank: null``) = per head ``[q_nope ; q_rope]`` (``q_rope`` spread to ``Dr'``), × the layer's
  ``q_scale`` (the writer's fold of DeepSeek's fixed ``(D + Dr')^-½`` softmax scale);
* ``kv_a_proj_with_mqa`` = ``[down ; k_rope]`` (latent rows padded through ``kv_a_layernorm``), ``kv_a_layernorm`` =
  the latent norm's weight, ``kv_b_proj`` = per query head ``[w_uk ; w_uv]`` (zero columns to ``P``);
* the rest of the block (``o_proj``, the two norms, the SwiGLU MLP) as the writer names them, and the embedding,
  final norm and untied ``lm_head``.

RoPE rows arrive interleaved (``rope_interleave: true``: :func:`interleave_index`); padding is exact
(:mod:`kvsplice.convert.latent_pad`). The families: :mod:`kvsplice.convert.deepseek_v3_llama` (a converted Llama,
:class:`models.mla_llama.MLALlama`) and :mod:`kvsplice.convert.deepseek_v3_gpt` (a trained ``layout="deepseek_v3"``
:class:`models.GPT`); the front door is :mod:`kvsplice.convert.deepseek_v3`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from kvsplice.convert.latent_pad import pad_columns, pad_normed_latent, padded_row, spread_rope_rows

__all__ = ["MLALayer", "WRITERS", "DeepSeekV3Writer", "dense_mla_config", "interleave_index",
           "portable_tokenizer_config", "register"]


@dataclass
class MLALayer:
    """One layer in DeepSeek-V3's terms (unpadded; RoPE rows interleaved)."""

    q_nope: torch.Tensor  # (H, D, d_model)
    q_rope: torch.Tensor  # (H, Dr, d_model)
    q_scale: float  # on the whole q_proj
    down: torch.Tensor  # (r, d_model): the cached latent's rows
    norm: torch.Tensor  # (r,): kv_a_layernorm's weight
    k_rope: torch.Tensor  # (Dr, d_model): the one shared RoPE key
    w_uk: torch.Tensor  # (H, D, r)
    w_uv: torch.Tensor  # (H, D, r)
    rest: dict[str, torch.Tensor] = field(default_factory=dict)  # o_proj, norms, MLP under the layer's prefix


class DeepSeekV3Writer:
    """A source family's half of the export (subclass and :func:`register`)."""

    family = "model"
    """The family's name in messages."""

    def __init__(self, model: Any):
        self.model = model

    @classmethod
    def accepts(cls, model: Any) -> bool:
        """Whether ``model`` is of this family."""
        raise NotImplementedError

    def check(self) -> None:
        """``ValueError`` (one line) unless the model maps onto DeepSeek-V3 exactly."""

    def row(self) -> tuple[int, int]:
        """The unpadded cache row ``(latent r, RoPE Dr)``."""
        raise NotImplementedError

    def config_fields(self) -> dict[str, Any]:
        """:func:`dense_mla_config`'s arguments but ``kv_lora_rank`` / ``qk_rope_head_dim``."""
        raise NotImplementedError

    def outer(self) -> dict[str, torch.Tensor]:
        """``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``."""
        raise NotImplementedError

    def layers(self, padded_rope: int) -> Iterator[MLALayer]:
        """Each layer's :class:`MLALayer` (``padded_rope``: ``Dr'``, for the softmax-scale fold)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ shared assembly
    def padded(self, pad_latent: Optional[int], pad_rope: Optional[int]) -> tuple[int, int]:
        """The exported ``(kv_lora_rank, qk_rope_head_dim)`` (ValueError, one line, for a size refused)."""
        return padded_row(*self.row(), pad_latent, pad_rope)

    def config(self, pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> dict[str, Any]:
        """The export's ``config.json``."""
        self.check()
        (r, dr), (rank, rope) = self.row(), self.padded(pad_latent, pad_rope)
        fields = self.config_fields()
        if (rank, rope) != (r, dr):
            fields["kvsplice"]["padded"] = {"kv_lora_rank": [r, rank], "qk_rope_head_dim": [dr, rope]}
        return dense_mla_config(**fields, kv_lora_rank=rank, qk_rope_head_dim=rope)

    @torch.no_grad()
    def state_dict(self, pad_latent: Optional[int] = None,
                   pad_rope: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The export's weights under transformers' DeepSeek-V3 names."""
        self.check()
        rank, rope = self.padded(pad_latent, pad_rope)
        sd = dict(self.outer())
        for i, ly in enumerate(self.layers(rope)):
            pre = f"model.layers.{i}."
            q = torch.cat([ly.q_nope, spread_rope_rows(ly.q_rope, rope)], dim=1)  # (H, D + Dr', d_model)
            sd[pre + "self_attn.q_proj.weight"] = (q * ly.q_scale).flatten(0, 1)  # (H·(D + Dr'), d_model)
            down, norm_w = pad_normed_latent(ly.down, ly.norm, rank)  # (P, d_model), (P,)
            k_rope = spread_rope_rows(ly.k_rope, rope)  # (Dr', d_model)
            sd[pre + "self_attn.kv_a_proj_with_mqa.weight"] = torch.cat([down, k_rope])  # (P + Dr', d_model)
            sd[pre + "self_attn.kv_a_layernorm.weight"] = norm_w
            kv_b = torch.cat([ly.w_uk, ly.w_uv], dim=1).flatten(0, 1)  # (H·2D, r): [k_nope ; v] per head
            sd[pre + "self_attn.kv_b_proj.weight"] = pad_columns(kv_b, rank)  # (H·2D, P)
            sd.update({pre + k: v for k, v in ly.rest.items()})
        return {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}

    def save(self, folder: Path, tokenizer: Optional[Any] = None, pad_latent: Optional[int] = None,
             pad_rope: Optional[int] = None) -> None:
        """Write ``model.safetensors``, ``config.json`` and (``tokenizer`` with ``save_pretrained``) the tokenizer
        into ``folder`` (a fresh temporary folder of :func:`kvsplice.io.folders.write_dir`)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        sd = self.state_dict(pad_latent, pad_rope)
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(self.config(pad_latent, pad_rope), indent=2) + "\n",
                                            encoding="utf-8")
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(folder))
            portable_tokenizer_config(folder)


WRITERS: list[type[DeepSeekV3Writer]] = []
"""The registered writers, one per source family."""


def register(cls: type[DeepSeekV3Writer]) -> type[DeepSeekV3Writer]:
    """Class decorator: ``cls`` writes its family's models (:func:`kvsplice.convert.deepseek_v3.writer_for`)."""
    WRITERS.append(cls)
    return cls


def dense_mla_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                     num_attention_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                     v_head_dim: int, max_position_embeddings: int, rms_norm_eps: float, rope_theta: float,
                     torch_dtype: str, kvsplice: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of a dense DeepSeek-V3 MLA without q-LoRA: every DeepSeek-V3 export of the package is
    written from here."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "moe_intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_attention_heads,
        "q_lora_rank": None, "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim,
        "qk_nope_head_dim": qk_nope_head_dim, "v_head_dim": v_head_dim,
        "first_k_dense_replace": num_hidden_layers, "n_routed_experts": 1, "n_shared_experts": 1,
        "num_experts_per_tok": 1, "n_group": None, "topk_group": None,  # null: llama.cpp asserts n_expert_groups < n_expert
        "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
        "rope_interleave": True, "rope_theta": rope_theta,  # transformers 4.x reads this one
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
        "torch_dtype": torch_dtype, "kvsplice": kvsplice,
    }


def interleave_index(n: int) -> torch.Tensor:
    """Index ``(2n,)`` taking rotate-half ``[x_0..x_{n-1}, y_0..y_{n-1}]`` to ``[x_0, y_0, x_1, y_1, ...]``."""
    return torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).flatten()


def portable_tokenizer_config(folder: Path) -> None:
    """Make ``tokenizer_config.json`` readable by transformers 4.x and 5.x: transformers 5 saves ``tokenizer_class:
    TokenizersBackend``, a class 4.x (llama.cpp's converter pins 4.57) does not have; ``PreTrainedTokenizerFast`` reads
    the same ``tokenizer.json`` in both."""
    p = Path(folder) / "tokenizer_config.json"
    if not p.is_file():
        return
    tc = json.loads(p.read_text(encoding="utf-8"))
    if tc.get("tokenizer_class") in ("TokenizersBackend", None):
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        p.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
