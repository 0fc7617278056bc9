"""vLLM's common MLA metadata without its row check (``kv_lora_rank + qk_rope_head_dim`` in 320 / 512 / 576): nothing
else in it depends on the row size. Imports vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata


@dataclass
class AnyRowMLAMetadata(MLACommonMetadata):
    """``MLACommonMetadata`` for any latent row."""

    def __post_init__(self) -> None:
        pass


__all__ = ["AnyRowMLAMetadata"]
