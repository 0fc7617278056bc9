"""The seed's capacity claim ("KVSplice 90 %: ~11,700 parallel sequences in 24 GB at 1,024 tokens, 18x throughput")
measured in llama.cpp on this CPU, for DeepSeek-V3-layout models at GPT-2-124M shapes (12 layers, d 768, 12 heads of
64, SwiGLU 3072, GPT-2's tokenizer) with RANDOM weights (speed and memory do not depend on them):

* standard attention (exported as a Llama: K and V per head, 2 x 768 numbers per token and layer);
* MLA, latent 256 + one 64-dim RoPE key; KVSplice-50 = latent 128 + 64; KVSplice-90 = latent 26 + 64 (
  "26 + 64"), each a DeepSeek-V3 folder through llama.cpp's own converter + ``kvsplice.to_gguf``'s post-step.

Per model and context (``--ctx``, default 1k and 4k): llama.cpp's own KV cache size per token (f16, from its log),
the largest number of parallel sequences of that many tokens its cache holds in ``--budget-gib``, and decode
tokens/s from ``llama-batched-bench`` at that batch -- capped at ``LLAMA_MAX_SEQ`` (256), the most sequences one
llama.cpp context decodes at once -- with flash attention on and off (``-fa``), interleaved repeats, medians; each
model's figure is its faster setting. The prompt is prefilled once and copied into every sequence's own cache stream
(``-pps``, a non-unified cache): each sequence holds ``ctx`` real cells and every decode step attends over all of
them, at the cost of one prefill instead of thousands. What bounds decode on a CPU: docs/conversion.md.

    KVSPLICE_LLAMA_CPP=... python benchmarks/engine_serving.py --out results/engine_serving
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # run as a file: the repository first on sys.path (benchmarks/_root.py)
    import _root  # noqa: F401

from benchmarks.harness.header import header  # noqa: E402
from benchmarks.harness.options import add_out, add_threads, command, parser  # noqa: E402
from benchmarks.harness.paths import DATA, RESULTS  # noqa: E402

GPT2 = DATA / "gpt2_tokenizer"

SHAPES = {"124m": dict(d=768, layers=12, heads=12, head_dim=64, ff=3072, vocab=50257),
          "tiny": dict(d=128, layers=2, heads=2, head_dim=64, ff=256, vocab=50257)}  # the tests' smoke run
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


def build(folder: Path, latent, s: dict) -> None:
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
    tokenizer().save_pretrained(folder)
    from kvsplice.convert.deepseek_v3 import portable_tokenizer_config

    portable_tokenizer_config(folder)


def name_of(latent) -> str:
    """The ``--latents`` key of a model: ``std`` or its latent size."""
    return "std" if latent is None else str(latent)


def ratio(x, digits: int) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


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


@command
def main(argv: list[str] | None = None) -> int:
    p = parser(__file__, __doc__)
    p.add_argument("--work", default="/tmp/engine_serving", help="where the GGUFs are built (reused when present)")
    add_out(p, RESULTS / "engine_serving", "writes OUT.json and OUT.md")
    p.add_argument("--shape", choices=sorted(SHAPES), default="124m", help="model shape (tiny: a smoke run)")
    p.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096], help="tokens per sequence")
    p.add_argument("--budget-gib", type=float, default=4.0, help="the KV cache budget")
    p.add_argument("--ntg", type=int, default=3, help="decode steps timed per batch")
    add_threads(p, help="threads per run (1: on a shared machine, ggml's spinning thread barriers stall under load)")
    p.add_argument("--flash-attn", nargs="+", choices=("auto", "on", "off"), default=["on", "off"],
                   help="llama.cpp's -fa settings, each timed (on this CPU its flash-attention kernel is slow for "
                        "MLA's odd head sizes); a model's figure is its faster setting, as a user would pick")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats (model by model), medians reported")
    p.add_argument("--latents", nargs="+", default=[name_of(r) for _, r in VARIANTS], metavar="std|R",
                   help="the models: std (standard attention) and MLA latent sizes R (each + a 64-dim RoPE key)")
    args = p.parse_args(argv)
    from kvsplice.convert.engines.llama_cpp import LlamaCppModel, hf_to_gguf, max_sequences, missing

    why = missing(bindings=True, programs=("llama-batched-bench",))
    if why:
        print(why)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cap = max_sequences()
    rows, t0 = [], time.time()
    names = dict((name_of(r), n) for n, r in VARIANTS)
    for key in args.latents:  # the models, their llama.cpp KV bytes and how many sequences fit
        latent = None if key == "std" else int(key)
        gguf = work / f"{args.shape}-{key}.gguf"
        if not gguf.is_file():
            build(work / f"{args.shape}-{key}", latent, SHAPES[args.shape])
            hf_to_gguf(work / f"{args.shape}-{key}", gguf, outtype="bf16")
        with LlamaCppModel(gguf, n_ctx=8192, cache_type="f16") as lm:
            kv, per_tok = lm.kv_cache(), lm.kv_bytes_per_token
        for ctx in args.ctx:
            seqs = int(args.budget_gib * 2 ** 30 // (per_tok * ctx))
            rows.append({"name": names.get(key, f"MLA {latent} + 64"), "kv_lora_rank": latent, "gguf": str(gguf),
                         "ctx": ctx, "kv_bytes_per_token_f16": per_tok, "kv_log": kv, "max_parallel_sequences": seqs,
                         "batch": max(1, min(seqs, cap)), "batched_bench": []})
    for rep in range(args.repeats):  # interleaved: a load change hits every model alike
        for r in rows:
            for fa in args.flash_attn:
                for b in bench(Path(r["gguf"]), r["ctx"], r["batch"], args.ntg, args.threads, fa):
                    r["batched_bench"].append({**b, "fa": fa, "repeat": rep})
            got = {b["fa"]: round(b["speed_tg"], 1) for b in r["batched_bench"] if b["repeat"] == rep}
            print(f"[{time.time() - t0:6.0f}s] repeat {rep + 1}: {r['name']}, ctx {r['ctx']}, B={r['batch']}: "
                  + ", ".join(f"-fa {fa}: {v} t/s" for fa, v in got.items()), flush=True)
    for r in rows:  # medians over the repeats; each model at its faster -fa setting
        r["decode_tps"] = {fa: statistics.median(b["speed_tg"] for b in r["batched_bench"] if b["fa"] == fa)
                           for fa in args.flash_attn}
        r["best_fa"] = max(args.flash_attn, key=r["decode_tps"].get)
        r["decode_tps_at_batch"] = r["decode_tps"][r["best_fa"]]
    for r in rows:
        std = next((s for s in rows if s["ctx"] == r["ctx"] and s["kv_lora_rank"] is None), None)
        r["capacity_vs_standard"] = std and r["max_parallel_sequences"] / max(std["max_parallel_sequences"], 1)
        r["decode_vs_standard"] = std and r["decode_tps_at_batch"] / std["decode_tps_at_batch"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {**header(__file__, argv, args.threads), "weights": "random (speed and memory do not depend on them)",
           "shape": {"name": args.shape, **SHAPES[args.shape]}, "args": vars(args), "llama_max_seq": cap,
           "load_average_at_end": os.getloadavg(),
           "rows": rows, "seconds": time.time() - t0}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"| model | context | KV bytes / token (f16, llama.cpp) | sequences in {args.budget_gib:g} GiB | "
             f"× standard | batch run (≤ {cap}) | "
             + " | ".join(f"decode t/s at that batch, -fa {fa}" for fa in args.flash_attn)
             + " | × standard (faster -fa) |",
             "|" + "---|" * (7 + len(args.flash_attn))]
    for r in rows:
        lines.append(f"| {r['name']} | {r['ctx']:,} | {r['kv_bytes_per_token_f16']:,.0f} | "
                     f"{r['max_parallel_sequences']:,} | {ratio(r['capacity_vs_standard'], 1)} | {r['batch']} | "
                     + " | ".join(f"{r['decode_tps'][fa]:.1f}" for fa in args.flash_attn)
                     + f" | {ratio(r['decode_vs_standard'], 2)} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
