"""Our int8 cache vs transformers' own 8-bit quantised cache on stories260K, at the same prompts.

    python -m benchmarks.hf_quant_cache --model /tmp/stories260K [--windows 16 --prompt 384 --cont 128 | --smoke]

Each window of real validation text: the prompt is prefilled, then the continuation is decoded token by token
(teacher-forced) and scored (the first continuation token is predicted by the prefill). Caches: the full fp32 K/V
cache (ours and HF's ``DynamicCache``, which must agree), our int8 cache (int8 rows + one fp16 scale per token and
head, ``Decoder(model, DenseKV(cache_quant="int8"))``), and transformers' ``QuantizedCache(backend="fp8")`` (float8
e4m3, one per-tensor scale frozen at the prefill; the only backend that needs no extra package). Bytes: measured
from each cache's tensors after the last token. A row per cache in ``results/hf_quant_cache.json``.
"""

from __future__ import annotations

import math

from benchmarks.harness.options import add_model, add_windows
from benchmarks.harness.runner import Study
from benchmarks.lib.doors import hf_nll
from benchmarks.lib.stories import load_stories, windows as text_windows
from kvsplice.decode import Decoder, DenseKV, score_continuation
from kvsplice.hf.measure import cache_nbytes


def score_hf(model, windows, prompt: int, cache) -> tuple[float, int]:
    return hf_nll(model, cache, windows, prompt, decode_chunk=1), cache_nbytes(cache)


def score_ours(model, windows, prompt: int, cache_quant) -> tuple[float, int]:
    dec = Decoder(model, DenseKV(cache_quant=cache_quant))
    nll, _, cache = score_continuation(dec, windows, prompt, decode_chunk=1)
    return nll, cache.nbytes()


def options(p) -> None:
    add_model(p, help="stories260K converted with kvsplice convert-llama2c", required=True)
    add_windows(p)


def rows(run):
    from transformers import DynamicCache, QuantizedCache

    loaded = load_stories(run.args.model)
    model, prompt = loaded.model.eval(), run["prompt"]
    windows, _ = text_windows(loaded, run.args.data, prompt + run["cont"], run["windows"], split="validation")
    full = None
    for name, fn in (
        ("full K/V (ours, fp32)", lambda: score_ours(model, windows, prompt, None)),
        ("HF DynamicCache (fp32)", lambda: score_hf(model, windows, prompt, DynamicCache(config=model.config))),
        ("int8 rows + fp16 scales (ours)", lambda: score_ours(model, windows, prompt, "int8")),
        ("HF QuantizedCache fp8 (per-tensor)", lambda: score_hf(model, windows, prompt,
                                                                QuantizedCache("fp8", model.config))),
    ):
        nll, nbytes = fn()
        full = full or (math.exp(nll), nbytes)
        run.say(f"{name:38s} ppl {math.exp(nll):.4f}  cache {nbytes:,} B")
        yield {"cache": name, "nll": nll, "ppl": math.exp(nll), "cache_bytes": nbytes,
               "ppl_vs_full": math.exp(nll) / full[0], "bytes_vs_full": full[1] / nbytes,
               "scored_tokens": run["windows"] * run["cont"]}


STUDY = Study("hf_quant_cache", __doc__, rows, options=options,
              bounds={"windows": (1, 4096), "prompt": (1, 1 << 16), "cont": (1, 1 << 16)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
