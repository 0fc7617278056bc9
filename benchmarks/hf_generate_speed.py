"""Per-token decode time inside HF ``generate()``: kvsplice coefficient caches vs transformers' ``DynamicCache``.

    python -m benchmarks.hf_generate_speed --model /tmp/stories260K --bases-post r4_post.safetensors \
        --bases-pre r4_pre.safetensors              # -> results/hf_generate_speed.json

Greedy ``generate()`` runs, the caches interleaved, on one validation-text prompt; a decode step is the interval
between two stamps of a stopping criterion (prefill excluded). A row per cache: the median over ``--repeats`` of each
run's median step, thread-CPU and wall, and the ratio to the default cache (its own copy of the model, ``sdpa``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import transformers

from benchmarks.harness.options import add_model
from benchmarks.harness.paths import EVAL
from benchmarks.harness.runner import Study
from benchmarks.lib.speed import interleaved

from kvsplice.hf import CoefficientHFCache
from kvsplice.lowrank.bases import KVBases


class Stamps(transformers.StoppingCriteria):
    """Records (thread-CPU, wall) time after every generation step; never stops generation."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def __call__(self, input_ids, scores, **kw):
        self.times.append((time.thread_time(), time.perf_counter()))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def one_run(model, ids, cache, n_new: int) -> tuple[float, float]:
    """Median decode-step (thread-CPU, wall) seconds of one ``generate()`` (the first stamp follows the prefill)."""
    st = Stamps()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n_new,
                       min_new_tokens=n_new, do_sample=False, stopping_criteria=[st], pad_token_id=0)
    cpu, wall = ([b - a for a, b in zip(t, t[1:])] for t in zip(*st.times))
    return statistics.median(cpu), statistics.median(wall)


def options(p) -> None:
    add_model(p, required=True)
    p.add_argument("--bases-post", required=True, help="post-RoPE bases (kvsplice fit-bases)")
    p.add_argument("--bases-pre", required=True, help="pre-RoPE bases")
    p.add_argument("--text", default=str(EVAL), help="prompt text")
    p.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, help="prompt length")
    p.add_argument("--new-tokens", dest="new_tokens", type=int, help="tokens generated per run")
    p.add_argument("--repeats", type=int, help="runs per cache")


def rows(run):
    args = run.args
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    base = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()  # default attention (sdpa)
    ours = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()  # switched to "kvsplice"
    text = Path(args.text).read_text(encoding="utf-8")[:20000]
    ids = torch.tensor([[tok.bos_token_id] + tok.encode(text, add_special_tokens=False)[:run["prompt_tokens"] - 1]])
    bases = {"post": KVBases.load(args.bases_post), "pre": KVBases.load(args.bases_pre)}
    makers = {"hf_dynamic": (base, lambda: transformers.DynamicCache(config=base.config)),
              **{f"coeff_{r}": (ours, lambda b=b: CoefficientHFCache(ours, b)) for r, b in bases.items()}}
    for model, make in makers.values():  # warm-up
        one_run(model, ids, make(), 8)
    runs, med = interleaved(makers, run["repeats"], lambda k: one_run(makers[k][0], ids, makers[k][1](),
                                                                       run["new_tokens"]))  # med[k]: [CPU, wall]
    for name, (cpu, wall) in med.items():
        row = {"cache": name, "ms_per_token_cpu": 1e3 * cpu, "ms_per_token_wall": 1e3 * wall,
               "ratio_cpu": cpu / med["hf_dynamic"][0], "ratio_wall": wall / med["hf_dynamic"][1],
               "ranks": bases[name[6:]].ranks() if name.startswith("coeff_") else None,
               "runs_ms_cpu": [1e3 * c for c, _ in runs[name]]}
        run.say(f"{name:11s} {row['ms_per_token_cpu']:.3f} ms/token CPU ({row['ratio_cpu']:.3f}x), "
                f"{row['ms_per_token_wall']:.3f} ms wall ({row['ratio_wall']:.3f}x)")
        yield row

STUDY = Study("hf_generate_speed", __doc__, rows, options=options, summary=lambda run, rows: {
    "transformers": transformers.__version__},
              bounds={"prompt_tokens": (2, 1 << 16), "new_tokens": (2, 1 << 14), "repeats": (1, 1000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
