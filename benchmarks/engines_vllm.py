"""DeepSeek-V3 exports in vLLM (CPU, its CPU_MLA backend) and llama.cpp beside our model and transformers: greedy
tokens, per-token log-probabilities, perplexity, the backend vLLM picked and the KV cache row it allocated.

    python -m benchmarks.engines_vllm --ckpt checkpoints/tiny_ds_mla_kvsplice_90/last.ckpt \\
        --text ../shared/data/tinystories/yuninxia_moe-routing-bench__tinystories_val.txt
    python -m benchmarks.engines_vllm --smollm2 --resume --force   # a row beside the earlier one
    python -m benchmarks.engines_vllm --resume --force              # only results/engines_vllm.md again
    python -m benchmarks.engines_vllm --ckpt CKPT --text TEXT --engines llama.cpp --tokens 128 --new 64

``--ckpt``: a trained ``deepseek_v3``-layout checkpoint; ``--smollm2``: the SmolLM2 GGUF converted (128 + 64 shared
RoPE). Exported unpadded (transformers) and padded to 512 + 64 (vLLM's CPU MLA kernel, with its RoPE as PyTorch code
and as its CPU op, which mis-indexes MLA's strided slices); ``--engines llama.cpp``: its converter, f16 KV bytes. One
row per model (``--resume`` keeps the others). An engine missing ($KVSPLICE_VLLM_PYTHON, $KVSPLICE_LLAMA_CPP): skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness import report
from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import CALIB, EVAL, SMOLLM2, TINYSTORIES
from benchmarks.harness.runner import Study
from benchmarks.lib.engines import compare, smollm2, trained_in_engines  # noqa: F401  (the tests call compare here)
from kvsplice.convert.engines import llama_cpp
from kvsplice.convert.engines import vllm as vllm_engine

ENGINES = {"ours": "ours (cached decode / full forward)", "transformers": "transformers, unpadded export",
           "transformers_padded": "transformers, padded export", "vllm": "vLLM, padded export (PyTorch RoPE)",
           "vllm_cpu_rope_op": "vLLM, padded export (its CPU RoPE op)", "llama.cpp": "llama.cpp, unpadded (f16 cache)"}
MISSING = {"vllm": vllm_engine.missing, "llama.cpp": lambda: llama_cpp.missing(bindings=True)}
SMOLLM2_NAME = "SmolLM2-135M converted"


def report_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The report's rows: each model's (``section`` models), then one per engine it ran in (engines)."""
    out = []
    for r in rows:
        spec = {k: v for k, v in r["model"].items() if k != "greedy_text"}  # the text: a column of its own
        out.append(dict(r, section="models", spec=json.dumps(spec)))
        out += [dict(section="engines", name=r["name"], engine=label, tokens=r["tokens"], new=r["new"],
                     ppl=r["perplexity"][key], d=r["max_abs_logprob_diff_vs_transformers"].get(key),
                     first=r["first_position_off_by_1e-3"].get(key), same=r["greedy_equal_to_transformers"].get(key))
                for key, label in ENGINES.items() if key in r["perplexity"]]
    return out


def options(ap) -> None:
    ap.add_argument("--ckpt", type=Path, help="a trained deepseek_v3-layout MLA / KVSplice checkpoint")
    ap.add_argument("--text", type=Path, default=EVAL)
    ap.add_argument("--smollm2", action="store_true", help="convert + export the shared SmolLM2 GGUF (a row too)")
    ap.add_argument("--tokens", type=int, default=None, help="scored tokens (default: 96 trained, 256 SmolLM2)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--engines", nargs="+", choices=tuple(MISSING), default=["vllm"], help="for --ckpt")


def rows(run):
    """The resumed rows of the models not run again, then a row per model asked for (``--ckpt``, ``--smollm2``)."""
    a = run.args
    why = {e: MISSING[e]() for e in (a.engines if a.ckpt else []) + (["vllm"] if a.smollm2 else [])}
    engines = [e for e in a.engines if not why.get(e)]
    for e in filter(why.get, why):
        run.say(f"{e} skipped: {why[e]}")
    stop = ((why.get("vllm") if a.smollm2 else None) or (None if engines or not a.ckpt else why[a.engines[0]])
            or (f"--ckpt {a.ckpt}: no such file" if a.ckpt and not a.ckpt.is_file() else None)
            or (f"--text {a.text}: no such file" if (a.ckpt or a.smollm2) and not a.text.is_file() else None))
    if stop:
        raise UsageError(stop)
    new = []
    if a.ckpt:
        r = trained_in_engines(a.ckpt, a.text.read_text(encoding="utf-8"), tokens=a.tokens or 96, new=a.new,
                               work=a.work, engines=engines)
        name = f"trained {r['model']['variant']}" + ("" if engines == ["vllm"] else f" in {' + '.join(engines)}")
        new.append(dict(r, name=name))
    if a.smollm2:
        new.append(dict(smollm2(gguf=SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf", text=CALIB,
                                calib=TINYSTORIES / "mines-opt-ml_decoding-gpt__tinystories_10k.txt",
                                tokens=a.tokens or 256, new=a.new, work=a.work), name=SMOLLM2_NAME))
    new = [dict(name=r.pop("name"), command=run.header["command"], **r) for r in new]
    yield from [r for r in run.done if r.get("name") not in {n["name"] for n in new}] + new


STUDY = Study("engines_vllm", __doc__, rows, options=options, threads=None,
              markdown=lambda run, rows: report.markdown(STUDY.spec("report"), report_rows(rows)))
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
