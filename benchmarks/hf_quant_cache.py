"""Our int8 cache vs transformers' own 8-bit quantised cache on stories260K, at the same prompts.

    python -m benchmarks.hf_quant_cache --model /tmp/stories260K [--windows 16 --prompt 384 --cont 128]

Each window of real validation text: the prompt is prefilled, then the continuation is decoded token by token
(teacher-forced) and scored (continuation perplexity: the first continuation token is predicted by the prefill).
Caches: the full fp32 K/V cache (ours and HF's ``DynamicCache``, which must agree), our int8 cache (int8 rows + one
fp16 scale per token and head, ``Decoder(model, DenseKV(cache_quant="int8"))``), and the installed
transformers' ``QuantizedCache(backend="fp8")`` (float8 e4m3, one per-tensor scale frozen at the prefill; the only
backend that needs no extra package). Bytes: measured from each cache's tensors after the last token. Writes
``results/hf_quant_cache.json``.
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F


from benchmarks.harness.header import command as command_line, revision
from benchmarks.harness.options import add_json, add_model, add_threads, add_windows, command, parser
from benchmarks.harness.paths import RESULTS

from kvsplice.io.outputs import write_json
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


@command
def main(argv=None) -> int:
    from transformers import DynamicCache, QuantizedCache

    p = parser(__file__, __doc__)
    add_model(p, help="stories260K converted with python -m kvsplice.convert_llama2c", required=True)
    add_windows(p, 16)
    add_json(p, RESULTS / "hf_quant_cache.json")
    add_threads(p)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    loaded = load_model(a.model)
    model = loaded.model.eval()
    n = a.prompt + a.cont
    ids, _ = token_stream(iter_texts(a.data, split="validation"), loaded.tokenizer, n * a.windows)
    windows = ids[: n * a.windows].view(a.windows, n)
    rows = {}
    for name, fn in (
        ("full K/V (ours, fp32)", lambda: score_ours(model, windows, a.prompt, None)),
        ("HF DynamicCache (fp32)", lambda: score_hf(model, windows, a.prompt, lambda: DynamicCache(config=model.config))),
        ("int8 rows + fp16 scales (ours)", lambda: score_ours(model, windows, a.prompt, "int8")),
        ("HF QuantizedCache fp8 (per-tensor)", lambda: score_hf(model, windows, a.prompt,
                                                                lambda: QuantizedCache("fp8", model.config))),
    ):
        nll, nbytes = fn()
        rows[name] = {"nll": nll, "ppl": math.exp(nll), "cache_bytes": nbytes}
        print(f"{name:38s} ppl {math.exp(nll):.4f}  cache {nbytes:,} B", flush=True)
    full = rows["full K/V (ours, fp32)"]
    for r in rows.values():
        r["ppl_vs_full"] = r["ppl"] / full["ppl"]
        r["bytes_vs_full"] = full["cache_bytes"] / r["cache_bytes"]
    report = {"model": a.model, "data": a.data, "windows": a.windows, "prompt": a.prompt, "cont": a.cont,
              "scored_tokens": a.windows * a.cont, "rows": rows, "seconds": round(time.time() - t0, 1),
              "command": command_line(__file__, argv), "revision": revision()}
    write_json(report, a.json)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
