"""The seed's capacity claim ("KVSplice 90 %: ~11,700 parallel sequences in 24 GB at 1,024 tokens, 18x throughput")
measured in llama.cpp on this CPU, for DeepSeek-V3-layout models at GPT-2-124M shapes (12 layers, d 768, 12 heads of
64, SwiGLU 3072, GPT-2's tokenizer) with RANDOM weights (speed and memory do not depend on them): standard attention
(a Llama export: K and V, 2 x 768 numbers per token and layer) and MLA with a latent of 256, 128 (KVSplice-50) or 26
(KVSplice-90) + one 64-dim RoPE key, each a DeepSeek-V3 folder through llama.cpp's converter + ``to_gguf``'s post-step.

Per model and context (``--ctx``): llama.cpp's own f16 KV bytes per token (its log), the most parallel sequences of
that many tokens in ``--budget-gib``, and decode tokens/s from ``llama-batched-bench`` at that batch (capped at
``LLAMA_MAX_SEQ``, 256: the most one context decodes at once), ``-fa`` on and off, interleaved repeats, medians; each
model at its faster setting. The prompt is prefilled once and copied into every sequence's own cache stream (``-pps``):
every decode step attends over ``ctx`` real cells per sequence. What bounds decode on a CPU: docs/conversion.md.

    KVSPLICE_LLAMA_CPP=... python -m benchmarks.engine_serving [--smoke]
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from benchmarks.harness.options import UsageError
from benchmarks.harness.runner import Study
from benchmarks.lib.llama_cpp_models import SHAPES

NAMES = {"std": "standard attention (Llama export)", "256": "MLA 256 + 64", "128": "KVSplice-50: 128 + 64",
         "26": "KVSplice-90: 26 + 64"}


def options(p) -> None:
    p.add_argument("--work", default="/tmp/engine_serving", help="where the GGUFs are built (reused when present)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="model shape (tiny: a smoke run)")
    p.add_argument("--ctx", type=int, nargs="+", help="tokens per sequence")
    p.add_argument("--budget-gib", type=float, help="the KV cache budget")
    p.add_argument("--ntg", type=int, help="decode steps timed per batch")
    p.add_argument("--flash-attn", nargs="+", choices=("auto", "on", "off"),
                   help="llama.cpp's -fa settings, each timed (on this CPU its flash-attention kernel is slow for "
                        "MLA's odd head sizes); a model's figure is its faster setting, as a user would pick")
    p.add_argument("--repeats", type=int, help="interleaved repeats (model by model), medians reported")
    p.add_argument("--latents", nargs="+", metavar="std|R",
                   help="the models: std (standard attention) and MLA latent sizes R (each + a 64-dim RoPE key)")


def models(run, work: Path, cap: int) -> list[dict]:
    """A row per model and context: its GGUF (built when missing), llama.cpp's KV bytes and the sequences that fit."""
    from benchmarks.lib.llama_cpp_models import build
    from kvsplice.convert.engines.gguf_convert import hf_to_gguf
    from kvsplice.convert.engines.llama_cpp import LlamaCppModel

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
    from benchmarks.lib.llama_cpp_models import bench
    from kvsplice.convert.engines.llama_cpp import max_sequences, missing

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
    return {"weights": "random (speed and memory do not depend on them)",
            "shape": {"name": run["shape"], **SHAPES[run["shape"]]}, **run.notes,
            "load_average_at_end": os.getloadavg()}


STUDY = Study("engine_serving", __doc__, rows, options=options, summary=summary,
              bounds={"ctx": (1, 1 << 20), "budget_gib": (1e-9, 1e6), "ntg": (1, 10_000), "repeats": (1, 1000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
