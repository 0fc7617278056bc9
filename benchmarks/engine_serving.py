"""The seed's capacity claim ("KVSplice 90 %: ~11,700 parallel sequences in 24 GB at 1,024 tokens, 18x throughput")
measured in llama.cpp on this CPU, for DeepSeek-V3-layout models at GPT-2-124M shapes (12 layers, d 768, 12 heads of
64, SwiGLU 3072, GPT-2's tokenizer) with RANDOM weights (speed and memory do not depend on them):

* standard attention (exported as a Llama: K and V per head, 2 x 768 numbers per token and layer);
* MLA, latent 256 + one 64-dim RoPE key; KVSplice-50 = latent 128 + 64; KVSplice-90 = latent 26 + 64 (the issue's
  "26 + 64"), each a DeepSeek-V3 folder through llama.cpp's own converter + ``kvsplice.to_gguf``'s post-step.

Per model: llama.cpp's own KV cache size per token (f16, from its log, 8,192 cells), the largest number of parallel
sequences of ``--ctx`` tokens its cache holds in ``--budget-gib``, and decode tokens/s from ``llama-batched-bench``
(``-npp ctx -ntg 16``) at the batches in ``--npl`` — NOT at that largest batch: filling thousands of 1k prompts is
hours of prefill on 2 cores. What bounds decode on a CPU is said in the table's note.

    KVSPLICE_LLAMA_CPP=... python benchmarks/engine_serving.py --out results/engine_serving
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GPT2 = ROOT.parent / "shared" / "data" / "gpt2_tokenizer"

SHAPE = dict(d=768, layers=12, heads=12, head_dim=64, ff=3072, vocab=50257)
VARIANTS = [("standard attention (Llama export)", None), ("MLA 256 + 64", 256), ("KVSplice-50: 128 + 64", 128),
            ("KVSplice-90: 26 + 64", 26)]


def tokenizer():
    """GPT-2's BPE from the shared data (a vocabulary llama.cpp's DeepSeek converter recognises)."""
    import transformers

    from tokenizers import ByteLevelBPETokenizer

    enc = json.loads((GPT2 / "encoder.json").read_text())
    vocab_json = Path("/tmp/kvsplice_gpt2_vocab.json")
    vocab_json.write_text(json.dumps(enc))
    bpe = ByteLevelBPETokenizer(str(vocab_json), str(GPT2 / "vocab.bpe"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                               bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    return tok


def build(folder: Path, latent) -> None:
    import transformers

    s = SHAPE
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
    tokenizer().save_pretrained(folder)
    from kvsplice.convert.deepseek_v3 import portable_tokenizer_config

    portable_tokenizer_config(folder)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/engine_serving")
    p.add_argument("--out", default=str(ROOT / "results" / "engine_serving"))
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--budget-gib", type=float, default=4.0)
    p.add_argument("--npl", default="1,4")
    p.add_argument("--ntg", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from kvsplice.engines.llama_cpp import LlamaCppModel, binary, hf_to_gguf, missing

    why = missing(bindings=True, programs=("llama-batched-bench",))
    if why:
        print(why)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.time()
    for name, latent in VARIANTS:
        folder, gguf = work / f"m{latent or 'std'}", work / f"m{latent or 'std'}.gguf"
        if not gguf.is_file():
            build(folder, latent)
            hf_to_gguf(folder, gguf, outtype="bf16")
        with LlamaCppModel(gguf, n_ctx=8192, cache_type="f16") as lm:
            kv = lm.kv_cache()
            per_tok = lm.kv_bytes_per_token
        seqs = int(args.budget_gib * 2 ** 30 // (per_tok * args.ctx))
        cmd = [str(binary("llama-batched-bench")), "-m", str(gguf), "-c", str(args.ctx * max(map(int, args.npl.split(",")))
                                                                             + 256),
               "-b", "2048", "-ub", "512", "-npp", str(args.ctx), "-ntg", str(args.ntg), "-npl", args.npl,
               "-t", str(args.threads), "-nr", "--output-format", "jsonl"]
        r = subprocess.run(cmd, capture_output=True, text=True, env={"LD_LIBRARY_PATH": str(binary("x").parent)})
        bench = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        row = {"name": name, "kv_lora_rank": latent, "kv_bytes_per_token_f16": per_tok, "kv_log": kv,
               "max_parallel_sequences": seqs, "batched_bench": bench,
               "error": None if r.returncode == 0 else r.stderr[-500:]}
        rows.append(row)
        print(f"[{time.time() - t0:6.0f}s] {name}: {per_tok:,.0f} B/token, {seqs:,} sequences of {args.ctx} in "
              f"{args.budget_gib} GiB; " + ", ".join(f"B={b.get('pl')}: decode {b.get('speed_tg', 0):.1f} t/s"
                                                   for b in bench), flush=True)
    std = rows[0]
    for r in rows:
        r["capacity_vs_standard"] = r["max_parallel_sequences"] / max(std["max_parallel_sequences"], 1)
        tg = {b["pl"]: b["speed_tg"] for b in r["batched_bench"]}
        r["decode_vs_standard"] = {pl: tg[pl] / s for pl, s in ((b["pl"], b["speed_tg"])
                                                                  for b in std["batched_bench"]) if pl in tg}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"weights": "random (speed and memory do not depend on them)", "shape": SHAPE, "args": vars(args),
           "rows": rows, "seconds": time.time() - t0}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    pls = [int(x) for x in args.npl.split(",")]
    head = "| model | KV bytes / token (f16, llama.cpp) | sequences of %d in %g GiB | × standard | " % (
        args.ctx, args.budget_gib) + " | ".join(f"decode t/s B={b}" for b in pls) + " |"
    lines = [head, "|" + "---|" * (4 + len(pls))]
    for r in rows:
        tg = {b["pl"]: b["speed_tg"] for b in r["batched_bench"]}
        lines.append(f"| {r['name']} | {r['kv_bytes_per_token_f16']:,.0f} | {r['max_parallel_sequences']:,} | "
                     f"{r['capacity_vs_standard']:.1f} | " + " | ".join(f"{tg.get(b, float('nan')):.1f}" for b in pls)
                     + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
