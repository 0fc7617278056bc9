"""Our int8 cache vs transformers' own 8-bit quantised cache on stories260K, at the same prompts.

    python -m benchmarks.hf_quant_cache --model /tmp/stories260K [--windows 16 --prompt 384 --cont 128 | --smoke]

Each window of real validation text: the prompt is prefilled, then the continuation is decoded token by token
(teacher-forced) and scored (continuation perplexity: the first continuation token is predicted by the prefill).
Caches: the full fp32 K/V cache (ours and HF's ``DynamicCache``, which must agree), our int8 cache (int8 rows + one
fp16 scale per token and head, ``Decoder(model, DenseKV(cache_quant="int8"))``), and the installed
transformers' ``QuantizedCache(backend="fp8")`` (float8 e4m3, one per-tensor scale frozen at the prefill; the only
backend that needs no extra package). Bytes: measured from each cache's tensors after the last token. A row per cache in
``results/hf_quant_cache.json``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


from benchmarks.harness.options import add_model, add_windows
from benchmarks.harness.runner import Study
from kvsplice.loading import iter_texts, load_model, token_stream
from kvsplice.decode import Decoder, DenseKV
from kvsplice.hf.measure import cache_nbytes, continuation_logits



@torch.no_grad()
def score_hf(model, windows, prompt: int, make_cache) -> tuple[float, int]:
    cache = make_cache()
    logits = continuation_logits(model, cache, windows, prompt, decode_chunk=1).float()  # (B, cont, V)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, prompt:].reshape(-1)).item()
    return nll, cache_nbytes(cache)


@torch.no_grad()
def score_ours(model, windows, prompt: int, cache_quant) -> tuple[float, int]:
    dec = Decoder(model, DenseKV(cache_quant=cache_quant))
    cache = dec.new_cache(windows.shape[0], capacity=windows.shape[1] - 1)
    logits = [dec(windows[:, :prompt], cache, last_only=True)]
    for i in range(prompt, windows.shape[1] - 1):
        logits.append(dec(windows[:, i:i + 1], cache))
    logits = torch.cat(logits, dim=1).float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, prompt:].reshape(-1)).item()
    return nll, cache.nbytes()


def options(p) -> None:
    add_model(p, help="stories260K converted with kvsplice convert-llama2c", required=True)
    add_windows(p)


def rows(run):
    from transformers import DynamicCache, QuantizedCache

    loaded = load_model(run.args.model)
    model = loaded.model.eval()
    prompt, n = run["prompt"], run["prompt"] + run["cont"]
    ids, _ = token_stream(iter_texts(run.args.data, split="validation"), loaded.tokenizer, n * run["windows"])
    windows = ids[: n * run["windows"]].view(run["windows"], n)
    full = None
    for name, fn in (
        ("full K/V (ours, fp32)", lambda: score_ours(model, windows, prompt, None)),
        ("HF DynamicCache (fp32)", lambda: score_hf(model, windows, prompt, lambda: DynamicCache(config=model.config))),
        ("int8 rows + fp16 scales (ours)", lambda: score_ours(model, windows, prompt, "int8")),
        ("HF QuantizedCache fp8 (per-tensor)", lambda: score_hf(model, windows, prompt,
                                                                lambda: QuantizedCache("fp8", model.config))),
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
