"""The seed's capacity claim ("KVSplice 90 %: ~11,700 parallel sequences in 24 GB at 1,024 tokens, 18x throughput")
in llama.cpp on this CPU, random weights at GPT-2-124M shapes: a Llama export and DeepSeek-V3 exports of latent 256,
128 or 26 + a 64-dim RoPE key. Per model and ``--ctx``: llama.cpp's f16 KV bytes per token, the sequences that fit
``--budget-gib``, ``llama-batched-bench``'s decode tokens/s at that batch (medians, the faster ``-fa`` setting).

    KVSPLICE_LLAMA_CPP=... python -m benchmarks.engine_serving [--smoke]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import DATA
from benchmarks.harness.runner import Study
from kvsplice.convert.engines.llama_cpp import LlamaCppModel, binary, max_sequences, missing

SHAPES = {"124m": dict(d=768, layers=12, heads=12, head_dim=64, ff=3072, vocab=50257),
          "tiny": dict(d=128, layers=2, heads=2, head_dim=64, ff=256, vocab=50257)}  # the tests' smoke run

NAMES = {"std": "standard attention (Llama export)", "256": "MLA 256 + 64", "128": "KVSplice-50: 128 + 64",
         "26": "KVSplice-90: 26 + 64"}


def options(p) -> None:
    p.add_argument("--work", default="/tmp/engine_serving", help="where the GGUFs are built (reused when present)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="model shape (tiny: a smoke run)")
    p.add_argument("--ctx", type=int, nargs="+", help="tokens per sequence")
    p.add_argument("--budget-gib", type=float, help="the KV cache budget")
    p.add_argument("--ntg", type=int, help="decode steps timed per batch")
    p.add_argument("--flash-attn", nargs="+", choices=("auto", "on", "off"), help="-fa settings (a model: its faster)")
    p.add_argument("--repeats", type=int, help="interleaved repeats (model by model), medians reported")
    p.add_argument("--latents", nargs="+", metavar="std|R", help="std (standard attention) or MLA latent R (+ 64 RoPE)")


def build(folder: Path, latent, s: dict) -> None:
    """A random-weight model of shape ``s`` (seed 0) in ``folder``: a Llama, or with ``latent`` a DeepSeek-V3."""
    import transformers

    from data.tokenizer import load_bpe_tokenizer
    from kvsplice.convert.deepseek_v3 import portable_tokenizer_config
    from training.export import save_tokenizer

    torch.manual_seed(0)
    common = dict(vocab_size=s["vocab"], hidden_size=s["d"], intermediate_size=s["ff"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["heads"], max_position_embeddings=8192,
                  tie_word_embeddings=False)
    if latent is None:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=s["head_dim"], **common))
    else:
        m = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            moe_intermediate_size=s["ff"], q_lora_rank=None, kv_lora_rank=latent, qk_rope_head_dim=64,
            qk_nope_head_dim=s["head_dim"], v_head_dim=s["head_dim"], first_k_dense_replace=s["layers"],
            n_routed_experts=1, num_experts_per_tok=1, n_group=None, topk_group=None, rope_interleave=True, **common))
    m.save_pretrained(folder)
    if latent is not None:  # what kvsplice.convert.deepseek_v3 writes for transformers 4.x readers
        c = json.loads((folder / "config.json").read_text())
        c["rope_theta"] = (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        (folder / "config.json").write_text(json.dumps(c, indent=2))
    save_tokenizer(load_bpe_tokenizer(DATA / "gpt2_tokenizer"), folder)  # a BPE llama.cpp's converter recognises
    portable_tokenizer_config(folder)


def bench(gguf: Path, ctx: int, batch: int, ntg: int, threads: int, flash_attn: str = "auto") -> list[dict]:
    """``llama-batched-bench``: a ``ctx``-token prompt prefilled once, copied to ``batch`` sequences, ``ntg`` steps."""
    cmd = [str(binary("llama-batched-bench")), "-m", str(gguf), "-c", str(batch * (ctx + ntg + 1)),
           "-b", "2048", "-ub", "512", "-npp", str(ctx), "-ntg", str(ntg), "-npl", str(batch), "-pps",
           "-fa", flash_attn, "-t", str(threads), "--output-format", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={"LD_LIBRARY_PATH": str(binary("x").parent)})
    if r.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed: {r.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def models(run, work: Path, cap: int) -> list[dict]:
    """A row per model and context: its GGUF (built when missing), llama.cpp's KV bytes and the sequences that fit."""
    from kvsplice.convert.engines.gguf_convert import hf_to_gguf

    rows, shape = [], run["shape"]
    for key in map(str, run["latents"]):
        latent = None if key == "std" else int(key)
        gguf = work / f"{shape}-{key}.gguf"
        if not gguf.is_file():
            build(work / f"{shape}-{key}", latent, SHAPES[shape])
            hf_to_gguf(work / f"{shape}-{key}", gguf, outtype="bf16")
        with LlamaCppModel(gguf, n_ctx=8192, cache_type="f16") as lm:
            kv, per_tok = lm.kv_cache(), lm.kv_bytes_per_token
        for ctx in run["ctx"]:
            seqs = int(run["budget_gib"] * 2 ** 30 // (per_tok * ctx))
            rows.append({"name": NAMES.get(key, f"MLA {latent} + 64"), "kv_lora_rank": latent, "gguf": str(gguf),
                         "ctx": ctx, "kv_bytes_per_token_f16": per_tok, "kv_log": kv, "max_parallel_sequences": seqs,
                         "batch": max(1, min(seqs, cap)), "batched_bench": []})
    return rows


def rows(run):
    why = missing(bindings=True, programs=("llama-batched-bench",))
    if why:
        raise UsageError(why)
    work, fas, t0 = Path(run.args.work), run["flash_attn"], time.time()
    work.mkdir(parents=True, exist_ok=True)
    cap = max_sequences()
    rows = models(run, work, cap)
    for rep in range(run["repeats"]):  # interleaved: a load change hits every model alike
        for r in rows:
            for fa in fas:
                for b in bench(Path(r["gguf"]), r["ctx"], r["batch"], run["ntg"], run.args.threads, fa):
                    r["batched_bench"].append({**b, "fa": fa, "repeat": rep})
            got = {b["fa"]: round(b["speed_tg"], 1) for b in r["batched_bench"] if b["repeat"] == rep}
            run.say(f"[{time.time() - t0:6.0f}s] repeat {rep + 1}: {r['name']}, ctx {r['ctx']}, B={r['batch']}: "
                    + ", ".join(f"-fa {fa}: {v} t/s" for fa, v in got.items()))
    for r in rows:  # medians over the repeats; each model at its faster -fa setting
        r["decode_tps"] = {fa: statistics.median(b["speed_tg"] for b in r["batched_bench"] if b["fa"] == fa)
                           for fa in fas}
        r["best_fa"] = max(fas, key=r["decode_tps"].get)
        r["decode_tps_at_batch"] = r["decode_tps"][r["best_fa"]]
    for r in rows:
        std = next((s for s in rows if s["ctx"] == r["ctx"] and s["kv_lora_rank"] is None), None)
        r["capacity_vs_standard"] = std and r["max_parallel_sequences"] / max(std["max_parallel_sequences"], 1)
        r["decode_vs_standard"] = std and r["decode_tps_at_batch"] / std["decode_tps_at_batch"]
    run.notes.update(llama_max_seq=cap, seconds=time.time() - t0)
    yield from rows


def summary(run, rows) -> dict:
    return {"weights": "random (speed and memory do not depend on them)", "shape": {"name": run["shape"],
            **SHAPES[run["shape"]]}, **run.notes, "load_average_at_end": os.getloadavg()}


STUDY = Study("engine_serving", __doc__, rows, options=options, summary=summary,
              bounds={"ctx": (1, 1 << 20), "budget_gib": (1e-9, 1e6), "ntg": (1, 10_000), "repeats": (1, 1000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
