"""Run one model folder in vLLM and write what :mod:`kvsplice.convert.engines.vllm` asks for: ``python vllm_worker.py REQ OUT``.

Executed by *vLLM's* interpreter (its own virtual environment, docs/conversion.md), so it imports only the standard
library, torch and vllm — never ``kvsplice``. ``REQ`` is a JSON request::

    {"model": DIR, "dtype": "float32", "max_model_len": 128, "kv_cache_bytes": 1073741824,
     "generate": [[ids...], new],          # greedy continuation of a prompt (optional)
     "score": [ids...],                    # log-probability of each token given the ones before (optional)
     "others": [[ids...], ...],            # other prompts run in the same batch as generate / score (optional)
     "throughput": {"seqs": n, "prompt": len, "new": n},   # decode tokens/s of n random prompts (optional;
                                           # seqs 0: as many as vLLM's cache holds at prompt + new tokens)
     "block_size": 32,                     # cache block size for non-MLA models (optional)
     "any_row": true,                      # rows other than 512 + 64: ask for CPU_MLA (the plugin's; AMX CPUs too)
     "native_rope": true}                  # see below

``OUT`` receives ``{"greedy": [...], "logprobs": [null, ...], "layers": [...], "cache_tokens": n, "vllm": version}``.
The kvsplice plugin (``vllm.general_plugins``) is loaded by vLLM itself when it is installed or on the path.

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


def _config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _throughput(llm, spec: dict) -> dict:
    """Greedy ``new`` tokens after each of ``seqs`` random ``prompt``-token prompts, stepped by hand. A step is a
    decode step when every sequence it advanced had its first token already (no prefill in it): decode tokens/s =
    the tokens of those steps over their seconds; ``max_batch`` is the most sequences one decode step advanced, and
    ``median_decode_tok_s`` that batch over the median time of the decode steps at it (robust to other jobs' bursts
    on a shared CPU)."""
    import time

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    vocab = int(_config(spec["model"])["vocab_size"])
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0.0, max_tokens=int(spec["new"]), ignore_eos=True, detokenize=False)
    n = int(spec["seqs"])
    if n <= 0:  # as many as vLLM's cache holds at full length
        cc = llm.llm_engine.vllm_config.cache_config
        n = int(cc.num_gpu_blocks) // -(-(int(spec["prompt"]) + int(spec["new"])) // int(cc.block_size))
    for i in range(n):
        ids = torch.randint(0, vocab, (int(spec["prompt"]),), generator=g).tolist()
        eng.add_request(f"t{i}", TokensPrompt(prompt_token_ids=ids), sp)
    got: dict = {}
    dec_s, dec_tok, steps, dec_steps, max_batch, full = 0.0, 0, 0, 0, 0, []
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        ts = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - ts
        new = {o.request_id: len(o.outputs[0].token_ids) - got.get(o.request_id, 0) for o in outs}
        if new and all(o.request_id in got for o in outs):  # only sequences past their prefill
            dec_s, dec_tok, dec_steps = dec_s + dt, dec_tok + sum(new.values()), dec_steps + 1
            max_batch = max(max_batch, len(new))
            full.append((len(new), dt))
        for o in outs:
            got[o.request_id] = len(o.outputs[0].token_ids)
        steps += 1
    total = sum(got.values())
    at_max = sorted(dt for b, dt in full if b == max_batch)  # the decode steps at the full batch
    median = at_max[len(at_max) // 2] if at_max else None
    return {"median_step_s": median, "median_decode_tok_s": max_batch / median if median else None,
            "full_batch_steps": len(at_max),"seqs": n, "prompt": int(spec["prompt"]), "new": int(spec["new"]), "seconds": time.perf_counter() - t0,
            "steps": steps, "decode_steps": dec_steps, "decode_seconds": dec_s, "decode_tokens": dec_tok,
            "tokens": total, "max_batch": max_batch, "decode_tok_s": dec_tok / dec_s if dec_s else None,
            "prefill_seconds": time.perf_counter() - t0 - dec_s}


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
                    "kernel": getattr(mod.impl, "kvsplice_kernel", "vllm"),
                    "backend": backend.get_name() if hasattr(backend, "get_name") else None,
                    "prefill_backend": (prefill.get_name() if hasattr(prefill, "get_name") else
                                        None if prefill is None else type(prefill).__name__),
                    "kv_cache_shape": list(kc.shape), "kv_cache_dtype": str(kc.dtype).replace("torch.", ""),
                    "kv_cache_bytes": kc.numel() * kc.element_size(),
                    "element_size": kc.element_size()})
    return out


def main(req_path: str, out_path: str) -> None:
    with open(req_path, encoding="utf-8") as f:
        req = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB only: the request's bytes instead
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if req.get("native_rope", True):
        kwargs["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    cfg = _config(req["model"])
    if req.get("any_row") and cfg.get("kv_lora_rank", 512) + cfg.get("qk_rope_head_dim", 64) != 576:
        kwargs["attention_config"] = {"backend": "CPU_MLA"}  # on AMX CPUs too (vLLM's AMX_MLA takes 576 only)
    if req.get("block_size") and cfg.get("kv_lora_rank") is None:  # MLA on CPU: vLLM's platform sets 16
        kwargs["block_size"] = int(req["block_size"])
    if req.get("max_num_seqs"):
        kwargs["max_num_seqs"] = int(req["max_num_seqs"])
    kv_bytes = int(req.get("kv_cache_bytes") or int(req.get("kv_cache_gib", 1)) * 2 ** 30)
    llm = LLM(model=req["model"], dtype=req.get("dtype", "float32"), enforce_eager=True,
              max_model_len=req["max_model_len"], skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=kv_bytes,
              **kwargs)
    res: dict = {"vllm": vllm.__version__, "native_rope": bool(req.get("native_rope", True)), "kv_cache_bytes": kv_bytes}
    others = [TokensPrompt(prompt_token_ids=p) for p in req.get("others") or []]
    if req.get("generate"):
        prompt, new = req["generate"]
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompt), *others], sp, use_tqdm=False)
        res["greedy"] = list(outs[0].outputs[0].token_ids)
    if req.get("score"):
        ids = req["score"]
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        got = llm.generate([TokensPrompt(prompt_token_ids=ids), *others], sp, use_tqdm=False)[0].prompt_logprobs
        res["logprobs"] = [None if d is None else d[t].logprob for d, t in zip(got, ids)]  # [0] is None
    if req.get("throughput"):
        res["throughput"] = _throughput(llm, {**req["throughput"], "model": req["model"]})
    cc = llm.llm_engine.vllm_config.cache_config
    res["cache_blocks"], res["block_size"] = int(cc.num_gpu_blocks or 0), int(cc.block_size)
    res["cache_tokens"] = res["cache_blocks"] * res["block_size"]  # vLLM's own count of KV cache tokens
    res["layers"] = llm.apply_model(_layers)[0]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
