"""Our int8 cache vs transformers' own 8-bit quantised cache on stories260K, at the same prompts.

    python -m benchmarks.hf_quant_cache --model /tmp/stories260K [--windows 16 --prompt 384 --cont 128 | --smoke]

Per window of validation text the prompt is prefilled, the continuation decoded token by token (teacher-forced) and
scored. Caches: the full fp32 cache (ours and HF's ``DynamicCache``: they must agree), our int8 rows + fp16 scales
and transformers' ``QuantizedCache("fp8")`` (per-tensor scale frozen at the prefill; no extra package). Bytes:
measured from each cache's tensors after the last token.
"""

from __future__ import annotations

import math

from benchmarks.harness.options import add_model, add_windows
from benchmarks.harness.runner import Study
from benchmarks.lib.doors import hf_nll
from benchmarks.lib.stories import load_stories, windows as text_windows
from kvsplice.decode import Decoder, DenseKV, score_continuation
from kvsplice.hf.measure import cache_nbytes


def options(p) -> None:
    add_model(p, help="stories260K converted with kvsplice convert-llama2c", required=True)
    add_windows(p)


def rows(run):
    from transformers import DynamicCache, QuantizedCache

    loaded = load_stories(run.args.model)
    model, prompt = loaded.model.eval(), run["prompt"]
    windows, _ = text_windows(loaded, run.args.data, prompt + run["cont"], run["windows"], split="validation")
    hf = lambda cache: (hf_nll(model, cache, windows, prompt, decode_chunk=1), cache_nbytes(cache))  # noqa: E731

    def ours(quant):
        nll, _, cache = score_continuation(Decoder(model, DenseKV(cache_quant=quant)), windows, prompt, decode_chunk=1)
        return nll, cache.nbytes()

    full = None
    for name, fn in (("full K/V (ours, fp32)", lambda: ours(None)),
                     ("HF DynamicCache (fp32)", lambda: hf(DynamicCache(config=model.config))),
                     ("int8 rows + fp16 scales (ours)", lambda: ours("int8")),
                     ("HF QuantizedCache fp8 (per-tensor)", lambda: hf(QuantizedCache("fp8", model.config)))):
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
