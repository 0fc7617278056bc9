"""vLLM's CPU MLA backend for any latent row: vLLM's own ``CPU_MLA`` descriptor, metadata and prefill, with the decode
(:func:`~.paged_mla.paged_latent_decode`) and cache write (:func:`~.paged_mla.write_latent_cache`) in PyTorch
whenever the row is not DeepSeek's 512 + 64, which keeps vLLM's C++ kernel (``mla_decode_kvcache``).

Imports vLLM: loaded by vLLM's backend registry through :func:`kvsplice.convert.engines.vllm_plugin.register`, never at
``import kvsplice`` time.
"""

from __future__ import annotations

from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from .metadata import AnyRowMLAMetadata
from .paged_mla import paged_latent_decode, write_latent_cache

VLLM_ROW = (512, 64)
"""(kv_lora_rank, qk_rope_head_dim) of the one row vLLM's CPU decode kernel compiles for: left to it."""


class AnyRowMLAMetadataBuilder(MLACommonMetadataBuilder[AnyRowMLAMetadata]):
    """vLLM's MLA metadata builder (block tables, slot mapping, decode / prefill split) building
    :class:`AnyRowMLAMetadata`."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs) -> None:
        kwargs.setdefault("metadata_cls", AnyRowMLAMetadata)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, **kwargs)


class AnyRowCPUMLAImpl(CPUMLAImpl):
    """``CPUMLAImpl`` whose decode and cache write run in PyTorch for rows other than 512 + 64."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvsplice_kernel = "vllm" if (self.kv_lora_rank, self.qk_rope_head_dim) == VLLM_ROW else "torch"

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if self.kvsplice_kernel == "vllm":
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        q_latent, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        dec = attn_metadata.decode
        out = paged_latent_decode(q_latent, q_pe, kv_c_and_k_pe_cache, dec.block_table, dec.seq_lens, self.scale)
        return out, None  # (B, N, L); no LSE: decode context parallelism is off on CPU

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        if self.kvsplice_kernel == "vllm":
            return super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        write_latent_cache(kv_cache, kv_c_normed, k_pe, slot_mapping)


class AnyRowCPUMLABackend(CPUMLABackend):
    """vLLM's ``CPU_MLA`` (same name, blocks of 16, dtypes) for any ``kv_lora_rank + qk_rope_head_dim``."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any row

    @staticmethod
    def get_impl_cls() -> type[AnyRowCPUMLAImpl]:
        return AnyRowCPUMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AnyRowMLAMetadataBuilder]:
        return AnyRowMLAMetadataBuilder


__all__ = ["AnyRowCPUMLABackend", "AnyRowCPUMLAImpl", "AnyRowMLAMetadataBuilder", "VLLM_ROW"]
