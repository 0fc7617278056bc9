"""Random-weight models at a given shape exported for llama.cpp, and ``llama-batched-bench`` run on one
(``benchmarks/engine_serving.py``): a Llama folder (standard attention) or a DeepSeek-V3 folder (MLA: a latent of
``R`` + one 64-dim RoPE key), GPT-2's tokenizer from the shared data."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from benchmarks.harness.paths import DATA

GPT2 = DATA / "gpt2_tokenizer"
SHAPES = {"124m": dict(d=768, layers=12, heads=12, head_dim=64, ff=3072, vocab=50257),
          "tiny": dict(d=128, layers=2, heads=2, head_dim=64, ff=256, vocab=50257)}  # the tests' smoke run


def build(folder: Path, latent, s: dict) -> None:
    """A random-weight model of shape ``s`` (seed 0) in ``folder``: a Llama, or with ``latent`` a DeepSeek-V3."""
    import transformers

    torch.manual_seed(0)
    if latent is None:
        cfg = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["d"], intermediate_size=s["ff"],
                                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                       num_key_value_heads=s["heads"], head_dim=s["head_dim"],
                                       max_position_embeddings=8192, tie_word_embeddings=False)
        m = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV3Config(
            vocab_size=s["vocab"], hidden_size=s["d"], intermediate_size=s["ff"], moe_intermediate_size=s["ff"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
            q_lora_rank=None, kv_lora_rank=latent, qk_rope_head_dim=64, qk_nope_head_dim=s["head_dim"],
            v_head_dim=s["head_dim"], first_k_dense_replace=s["layers"], n_routed_experts=1, num_experts_per_tok=1,
            n_group=None, topk_group=None, max_position_embeddings=8192, tie_word_embeddings=False,
            rope_interleave=True)
        m = transformers.DeepseekV3ForCausalLM(cfg)
    m.save_pretrained(folder)
    if latent is not None:  # what kvsplice.convert.deepseek_v3 writes for transformers 4.x readers
        c = json.loads((folder / "config.json").read_text())
        c["rope_theta"] = (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        (folder / "config.json").write_text(json.dumps(c, indent=2))
    from data.tokenizer import load_bpe_tokenizer
    from kvsplice.convert.deepseek_v3 import portable_tokenizer_config
    from training.export import save_tokenizer

    save_tokenizer(load_bpe_tokenizer(GPT2), folder)  # GPT-2's BPE: a vocabulary llama.cpp's converter recognises
    portable_tokenizer_config(folder)


def bench(gguf: Path, ctx: int, batch: int, ntg: int, threads: int, flash_attn: str = "auto") -> list[dict]:
    """``llama-batched-bench`` at ``batch``: one prompt of ``ctx`` tokens prefilled once, copied into every
    sequence's own cache stream, then ``ntg`` decode steps of one token per sequence."""
    from kvsplice.convert.engines.llama_cpp import binary

    cmd = [str(binary("llama-batched-bench")), "-m", str(gguf), "-c", str(batch * (ctx + ntg + 1)),
           "-b", "2048", "-ub", "512", "-npp", str(ctx), "-ntg", str(ntg), "-npl", str(batch), "-pps",
           "-fa", flash_attn, "-t", str(threads), "--output-format", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={"LD_LIBRARY_PATH": str(binary("x").parent)})
    if r.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed: {r.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
