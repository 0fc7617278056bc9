"""Run one model folder in vLLM and write what :mod:`kvsplice.convert.engines.vllm` asks for: ``python vllm_worker.py REQ OUT``.

Executed by *vLLM's* interpreter (its own virtual environment, docs/conversion.md), so it imports only the standard
library, torch and vllm — never ``kvsplice``. ``REQ`` is a JSON request::

    {"model": DIR, "dtype": "float32", "max_model_len": 128, "kv_cache_gib": 1,
     "generate": [[ids...], new],          # greedy continuation of a prompt (optional)
     "score": [ids...],                    # log-probability of each token given the ones before (optional)
     "native_rope": true}                  # see below

``OUT`` receives ``{"greedy": [...], "logprobs": [null, ...], "backend": ..., "kv_cache": {...}, "vllm": version}``.

``native_rope`` (default true) runs vLLM's RoPE as its own PyTorch code (``custom_ops: ["all",
"-rotary_embedding"]``) instead of the CPU C++ op ``rotary_embedding`` (``csrc/cpu/pos_encoding.cpp``): MLA hands that
op the 3-D strided slices ``q[..., nope:]`` (T, H, Dr) and ``k_pe`` (T, 1, Dr), from which it derives
``num_tokens = T·H`` and ``num_heads = 1`` and so rotates query head ``h`` of token ``t`` at position
``positions[t·H + h]`` and the key rows at the wrong stride — every position but 0 is wrong (measured:
results/engines_vllm.md). The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the attention layers
(backend, KV cache tensors) can be read after loading.
"""

from __future__ import annotations

import json
import os
import sys

# this file sits beside kvsplice/convert/engines/vllm.py, and a script's folder comes first on sys.path: drop it, so that
# ``import vllm`` is vLLM's package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _layers(model) -> list[dict]:
    """Per attention layer: its backend and the shape / dtype of the KV cache vLLM allocated for it."""
    out = []
    for name, mod in model.named_modules():
        if not (hasattr(mod, "impl") and hasattr(mod, "kv_cache")):
            continue
        kc = mod.kv_cache[0] if isinstance(mod.kv_cache, (list, tuple)) else mod.kv_cache
        backend = getattr(mod, "attn_backend", None)
        prefill = getattr(mod, "prefill_backend", None)
        out.append({"name": name, "impl": type(mod.impl).__name__,
                    "backend": backend.get_name() if hasattr(backend, "get_name") else None,
                    "prefill_backend": (prefill.get_name() if hasattr(prefill, "get_name") else
                                        None if prefill is None else type(prefill).__name__),
                    "kv_cache_shape": list(kc.shape), "kv_cache_dtype": str(kc.dtype).replace("torch.", ""),
                    "element_size": kc.element_size()})
    return out


def main(req_path: str, out_path: str) -> None:
    with open(req_path, encoding="utf-8") as f:
        req = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(req.get("kv_cache_gib", 1))))  # whole GiB
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if req.get("native_rope", True):
        kwargs["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    llm = LLM(model=req["model"], dtype=req.get("dtype", "float32"), enforce_eager=True,
              max_model_len=req["max_model_len"], skip_tokenizer_init=True, seed=0, **kwargs)
    res: dict = {"vllm": vllm.__version__, "native_rope": bool(req.get("native_rope", True))}
    if req.get("generate"):
        prompt, new = req["generate"]
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        res["greedy"] = list(llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
                             .outputs[0].token_ids)
    if req.get("score"):
        ids = req["score"]
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        got = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0].prompt_logprobs
        res["logprobs"] = [None if d is None else d[t].logprob for d, t in zip(got, ids)]  # [0] is None
    res["layers"] = llm.apply_model(_layers)[0]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
