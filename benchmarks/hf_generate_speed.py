"""Per-token decode time inside HF ``generate()``: kvsplice coefficient caches vs transformers' ``DynamicCache``.

::

    python -m benchmarks.hf_generate_speed --model /tmp/stories260K --bases-post r4_post.safetensors \
        --bases-pre r4_pre.safetensors --json results/hf_generate_speed.json

One greedy ``generate()`` per cache and repeat, interleaved (default cache, post-RoPE, pre-RoPE, default, ...), on
the same prompt of ``--prompt-tokens`` real validation-text tokens, ``--new-tokens`` tokens each (EOS suppressed).
A stopping criterion stamps the clock after every step; a decode step's time is the interval between two stamps
(the prefill is excluded). Per run: the median step; reported: the median over ``--repeats`` runs, as thread-CPU
time (robust to other processes on a shared machine) and wall time, and each cache's ratio to the default cache.
The baseline runs on its own copy of the model with transformers' default ``sdpa`` attention. torch threads = 1.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import transformers


from benchmarks.harness.options import add_force, add_json, add_model, command, parser
from benchmarks.harness.paths import EVAL

from kvsplice.hf import CoefficientHFCache
from kvsplice.io.outputs import output_file, write_json
from kvsplice.lowrank.bases import KVBases




class Stamps(transformers.StoppingCriteria):
    """Records (thread-CPU, wall) time after every generation step; never stops generation."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def __call__(self, input_ids, scores, **kw):
        self.cpu.append(time.thread_time())
        self.wall.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def one_run(model, ids, cache, n_new: int) -> tuple[float, float]:
    """Median decode-step (thread-CPU, wall) seconds of one ``generate()``."""
    st = Stamps()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n_new,
                       min_new_tokens=n_new, do_sample=False, stopping_criteria=[st], pad_token_id=0)
    cpu = [b - a for a, b in zip(st.cpu, st.cpu[1:])]  # decode steps only: the first stamp follows the prefill
    wall = [b - a for a, b in zip(st.wall, st.wall[1:])]
    return statistics.median(cpu), statistics.median(wall)


@command
def main(argv=None) -> int:
    p = parser(__file__, __doc__)
    add_model(p, required=True)
    p.add_argument("--bases-post", required=True)
    p.add_argument("--bases-pre", required=True)
    p.add_argument("--text", default=str(EVAL))
    p.add_argument("--prompt-tokens", type=int, default=384)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=15)
    add_json(p)
    add_force(p)
    args = p.parse_args(argv)
    if args.json:
        output_file(args.json, force=args.force, option="--json")
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    base = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()  # default attention (sdpa)
    ours = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()  # switched to "kvsplice"
    text = Path(args.text).read_text(encoding="utf-8")[:20000]
    ids = torch.tensor([[tok.bos_token_id] + tok.encode(text, add_special_tokens=False)[:args.prompt_tokens - 1]])
    bases = {"post": KVBases.load(args.bases_post), "pre": KVBases.load(args.bases_pre)}
    makers = {"hf_dynamic": (base, lambda: transformers.DynamicCache(config=base.config)),
              "coeff_post": (ours, lambda: CoefficientHFCache(ours, bases["post"])),
              "coeff_pre": (ours, lambda: CoefficientHFCache(ours, bases["pre"]))}
    for model, make in makers.values():  # warm-up
        one_run(model, ids, make(), 8)
    runs = {k: {"cpu": [], "wall": []} for k in makers}
    for r in range(args.repeats):
        for name, (model, make) in makers.items():
            cpu, wall = one_run(model, ids, make(), args.new_tokens)
            runs[name]["cpu"].append(cpu)
            runs[name]["wall"].append(wall)
    med = {k: {m: statistics.median(v[m]) for m in ("cpu", "wall")} for k, v in runs.items()}
    rows = {}
    for name in makers:
        rows[name] = {"ms_per_token_cpu": 1e3 * med[name]["cpu"], "ms_per_token_wall": 1e3 * med[name]["wall"],
                      "ratio_cpu": med[name]["cpu"] / med["hf_dynamic"]["cpu"],
                      "ratio_wall": med[name]["wall"] / med["hf_dynamic"]["wall"]}
        print(f"{name:11s} {rows[name]['ms_per_token_cpu']:.3f} ms/token CPU ({rows[name]['ratio_cpu']:.3f}x), "
              f"{rows[name]['ms_per_token_wall']:.3f} ms wall ({rows[name]['ratio_wall']:.3f}x)")
    report = {"model": args.model, "bases": {"post": args.bases_post, "pre": args.bases_pre},
              "ranks": {k: b.ranks() for k, b in bases.items()}, "prompt_tokens": ids.shape[1],
              "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": 1, "torch": torch.__version__,
              "transformers": transformers.__version__, "results": rows,
              "runs_ms_cpu": {k: [1e3 * x for x in v["cpu"]] for k, v in runs.items()}}
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
