"""vLLM's ``TRITON_MLA`` for any latent row on CUDA: its descriptor already declares every head size and its Triton
decode kernel sizes its scratch by ``kv_lora_rank + 1``; only vLLM's common MLA metadata refuses rows other than
320 / 512 / 576, so the builder here builds :class:`~.metadata.AnyRowMLAMetadata` instead.

Imports vLLM (and its Triton kernels): loaded by vLLM's backend registry on CUDA only.
"""

from __future__ import annotations

from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAMetadataBuilder

from .metadata import AnyRowMLAMetadata


class AnyRowTritonMLAMetadataBuilder(TritonMLAMetadataBuilder):
    """vLLM's Triton MLA metadata builder building :class:`AnyRowMLAMetadata`."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.metadata_cls = AnyRowMLAMetadata


class AnyRowTritonMLABackend(TritonMLABackend):
    """``TRITON_MLA`` whose metadata takes any row."""

    @staticmethod
    def get_builder_cls() -> type[AnyRowTritonMLAMetadataBuilder]:
        return AnyRowTritonMLAMetadataBuilder


__all__ = ["AnyRowTritonMLABackend", "AnyRowTritonMLAMetadataBuilder"]
