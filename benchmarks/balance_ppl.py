"""Perplexity of a continuation decoded over a token-selected (compressed) prompt cache: BalanceKV vs baselines.

    python -m benchmarks.balance_ppl           # stories260K → results/balance_ppl.{json,md,png} (≈ 2 min)
    python -m benchmarks.balance_ppl --model DIR|CKPT --data PATH [--prompt 384 --ratios 2 4 8 --seeds 3 ...]

Per window the prompt is prefilled, every layer's K/V compressed per KV head to ``prompt // ratio`` tokens and the
continuation decoded teacher-forced over it and scored (:func:`kvsplice.select.method.run_token_selection`);
ppl = exp(total NLL / tokens), random methods mean ± std over ``--seeds``. Methods: ``full`` (checked against the
model's own logits), ``balancekv`` (sinks + recent intact, the middle halved by the self-balancing walk),
``uniform``, ``streamingllm`` and ``coinflip`` (BalanceKV's plan, each halving a random half: ``c_scale = inf``).
"""

from __future__ import annotations

import math

import torch

from benchmarks.harness.options import add_model, add_windows
from benchmarks.harness.runner import Study
from benchmarks.lib.stories import load_stories, windows as text_windows
from kvsplice.select.method import run_token_selection
from kvsplice.select.selectors import balance_plan, make_selector

COMPRESSED = ("balancekv", "uniform", "streamingllm", "coinflip")
N_SINK, N_RECENT, BLOCK = 4, 16, 64
SELECTORS = {  # method → (selector, its arguments beside n_sink and seed)
    "full": ("streaming_llm", {}), "streamingllm": ("streaming_llm", {}),
    "balancekv": ("balancekv", {"n_recent": N_RECENT, "block_size": BLOCK}),
    "coinflip": ("balancekv", {"n_recent": N_RECENT, "block_size": BLOCK, "c_scale": math.inf}),
    "uniform": ("uniform", {"n_recent": N_RECENT})}


def evaluate(model, windows: torch.Tensor, prompt: int, method: str, budget: int, seed: int, batch: int) -> dict:
    """Total NLL / tokens of the continuation over all windows for one method, budget and seed."""
    name, kw = SELECTORS[method]
    sel = make_selector(name, n_sink=N_SINK, seed=seed, **kw)
    total, n = 0.0, 0
    for ids in windows.split(batch):
        res = run_token_selection(model, ids, sel, budget, prompt_len=prompt)
        total, n = total + res.nll * res.n_scored, n + res.n_scored
    return {"nll": total / n, "ppl": math.exp(total / n), "tokens": n, "cache_nbytes_last_batch": res.cache_nbytes,
            "full_nbytes_last_batch": res.full_nbytes}


@torch.no_grad()
def hf_reference_nll(model, windows: torch.Tensor, prompt: int, batch: int) -> float:
    """The continuation's NLL from the model's own forward (no cache)."""
    total = 0.0
    for ids in windows.split(batch):
        out = model(ids)
        logits = (out if isinstance(out, torch.Tensor) else out.logits)[:, prompt - 1:-1].float()
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, prompt:].reshape(-1),
                                                   reduction="sum").item()
    return total / windows[:, prompt:].numel()


def options(p) -> None:
    add_model(p, help="HF model dir or .ckpt (default: stories260K, converted to a temp dir)")
    add_windows(p)
    p.add_argument("--ratios", type=int, nargs="+", help="how many times smaller the prompt's cache")
    p.add_argument("--seeds", type=int, help="seeds of the random methods")
    p.add_argument("--batch", type=int, help="windows per forward")


def rows(run):
    prompt, batch = run["prompt"], run["batch"]
    loaded = load_stories(run.args.model)
    windows, n_stories = text_windows(loaded, run.args.data, prompt + run["cont"], run["windows"])
    model = loaded.model
    full = evaluate(model, windows, prompt, "full", prompt, 0, batch)
    hf = hf_reference_nll(model, windows, prompt, batch)
    run.say(f"full cache: ppl {full['ppl']:.4f} (HF model {math.exp(hf):.4f})")
    yield {"ratio": 1, "method": "full", "budget": prompt, **full, "ppl_mean": full["ppl"], "ppl_std": 0.0, "seeds": 1,
           "hf_model_nll": hf, "matches_hf_model": abs(full["nll"] - hf) < 1e-4,
           "windows": windows.shape[0], "stories": n_stories, "scored_tokens": windows.shape[0] * run["cont"],
           "model": loaded.describe()}
    for r in run["ratios"]:
        budget = prompt // r
        s, segs = balance_plan(prompt, budget, N_SINK, N_RECENT)
        plan = {"sinks": s, "segments (start, length, halvings)": segs,
                "intact_recent": prompt - (segs[-1][0] + segs[-1][1]) if segs else budget - s}
        for m in COMPRESSED:
            seeds = 1 if m == "streamingllm" else run["seeds"]
            runs = [evaluate(model, windows, prompt, m, budget, sd, batch) for sd in range(seeds)]
            ppl = torch.tensor([x["ppl"] for x in runs])
            row = {"ratio": r, "method": m, "budget": budget, "ppl_mean": float(ppl.mean()),
                   "ppl_std": float(ppl.std()) if seeds > 1 else 0.0, "ppl_per_seed": ppl.tolist(),
                   "nll_mean": float(torch.tensor([x["nll"] for x in runs]).mean()), "seeds": seeds,
                   "cache_nbytes_last_batch": runs[0]["cache_nbytes_last_batch"],
                   **({"balancekv_plan": plan} if m == "balancekv" else {})}
            run.say(f"{r}x (budget {budget}) {m}: ppl {row['ppl_mean']:.4f} ± {row['ppl_std']:.4f}")
            yield row


STUDY = Study("balance_ppl", __doc__, rows, options=options,
              summary=lambda run, rows: {"n_sink": N_SINK, "n_recent": N_RECENT, "block_size": BLOCK,
                                         "walk_threshold": "c = 1.0 * median kappa per block"},
              bounds={"windows": (1, 100000), "prompt": (8, 1 << 16), "cont": (1, 1 << 16), "ratios": (1, 1024),
                      "seeds": (1, 100), "batch": (1, 4096)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
