"""A trained checkpoint of the DeepSeek-V3-layout family in three engines: ours, transformers and llama.cpp.

    python -m benchmarks.engines_trained --ckpt checkpoints/tiny_ds_mla_kvsplice_90/last.ckpt \\
        --text ../shared/data/tinystories/yuninxia_moe-routing-bench__tinystories_val.txt

The checkpoint exported (``deepseek_v3``, or ``llama`` for standard attention) and converted by llama.cpp's own
converter (``to_gguf``); on ``--tokens`` of ``--text``: each engine's perplexity, whether the greedy ``--new`` tokens
after an 8-token prompt agree, and llama.cpp's f16 KV bytes per token against our f16 cache's, measured. Needs
llama.cpp (``$KVSPLICE_LLAMA_CPP`` or ``build/engines/llama.cpp``; docs/conversion.md).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional

import torch
import transformers

from benchmarks.harness.options import UsageError
from benchmarks.harness.runner import Study
from benchmarks.lib.engines import in_llama_cpp, load_trained, ppl
from kvsplice.convert.engines import gguf_convert, llama_cpp
from kvsplice.report.memory import cache_bytes_formula, measure_cache

BYTES_CELLS = 65536  # the cells llama.cpp's MiB (2 decimals) are read at: ± 0.005 MiB / 65,536 = ± 0.08 B a token


@torch.no_grad()
def compare(ckpt: Path, text: str, *, tokens: int = 128, new: int = 64, work: Optional[Path] = None) -> dict[str, Any]:
    """Export + convert ``ckpt`` under ``work`` and compare the three engines on ``text`` (see the module)."""
    from training.export import export_kind

    model, cfg, _, work, ids = load_trained(ckpt, text, tokens, work, "engines_trained_")
    gguf_convert.hf_to_gguf(work / "hf", work / "model.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.float32).eval()
    x, prompt = torch.tensor([ids]), torch.tensor([ids[:8]])  # (1, T), (1, 8)
    g_ours = model.generate(prompt, new, temperature=0.0)[0, 8:].tolist()  # our decode cache
    g_hf = hf.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new)[0, 8:].tolist()
    cpp = in_llama_cpp(work / "model.gguf", ids, ids[:8], new, n_ctx=max(len(ids), 8 + new) + 8)
    with llama_cpp.LlamaCppModel(work / "model.gguf", n_ctx=BYTES_CELLS, cache_type="f16") as lm:
        cpp_bytes = lm.kv_bytes_per_token
    half = copy.deepcopy(model).half()
    cache = half.new_cache(1, capacity=len(ids))
    half(x, cache=cache)
    p = {"ours": ppl(model(x)[0], ids), "transformers": ppl(hf(x).logits[0], ids), "llama.cpp": cpp["ppl"]}
    return {"ckpt": str(ckpt), "variant": cfg.variant, "format": export_kind(cfg), "tokens": len(ids),
            "perplexity": p, "max_rel_ppl_diff": max(abs(v / p["ours"] - 1) for v in p.values()),
            "greedy": {"ours": g_ours, "transformers": g_hf, "llama.cpp": cpp["greedy"]},
            "greedy_equal": g_ours == g_hf == cpp["greedy"],
            "kv_bytes_per_token": {"ours_f16": measure_cache(cache).live_bytes / len(ids), "llama.cpp_f16": cpp_bytes,
                                   "formula_f16": cache_bytes_formula(cfg, 1, torch.float16),
                                   "llama.cpp_rounding": 0.005 * 2 ** 20 / BYTES_CELLS}}


def options(p) -> None:
    p.add_argument("--ckpt", required=True, type=Path, help="a training checkpoint (.ckpt)")
    p.add_argument("--text", required=True, type=Path, help="the text scored")
    p.add_argument("--tokens", type=int, help="tokens scored (at most the model's block_size)")
    p.add_argument("--new", type=int, help="greedy tokens compared")


def rows(run):
    a = run.args
    why = llama_cpp.missing(bindings=True) or next((f"{what} {path}: no such file" for path, what in
                                                    ((a.ckpt, "--ckpt"), (a.text, "--text")) if not path.is_file()), None)
    if why:
        raise UsageError(why)
    row = compare(a.ckpt, a.text.read_text(encoding="utf-8"), tokens=run["tokens"], new=run["new"])
    run.say(json.dumps(row, indent=1))
    yield row


STUDY = Study("engines_trained", __doc__, rows, options=options, threads=None,
              bounds={"tokens": (2, 1 << 16), "new": (1, 4096)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
