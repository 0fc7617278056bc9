"""The markdown tables of ``benchmarks/serving.py``: capacity and decode throughput at a budget, the attention call
alone (and at forced split counts)."""

from __future__ import annotations

from benchmarks.lib.serving_bench import CLAIM
from kvsplice.report.tables import cell


def capacity_table(rows: list[dict], budget_gb: float, max_batch: int) -> list[str]:
    out = [f"## Capacity and decode throughput at a {budget_gb:g} GB budget", "",
           f"Claim: {CLAIM}. Measured: the rows below (max batch = budget / bytes per sequence; the step runs at "
           f"min(max batch, --max-batch {max_batch})).", "",
           "| variant | rows | context | bytes/seq | max batch | x MHA | batch run | SDPA ms | SDPA tok/s | "
           "split-KV ms | split-KV tok/s | split-KV vs MHA SDPA | floor ms | split-KV % floor |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['variant']} | {r['rows']} | {r['ctx']:,} | {r['bytes_per_seq']:,} | {r['max_batch']:,} | "
            f"{cell(r.get('batch_vs_mha'), '{:.1f}x')} | {r['batch']:,} | "
            f"{cell(r.get('sdpa_ms')) if 'sdpa_error' not in r else r['sdpa_error']} | "
            f"{cell(r.get('sdpa_tokens_per_s'), '{:,.0f}')} | "
            f"{cell(r.get('split_kv_ms')) if 'split_kv_error' not in r else r['split_kv_error']} | "
            f"{cell(r.get('split_kv_tokens_per_s'), '{:,.0f}')} | {cell(r.get('split_kv_vs_mha_sdpa'), '{:.1f}x')} | "
            f"{r['floor_ms']:.3f} | {cell(r.get('split_kv_pct_floor'), '{:.0f} %')} |")
    return out + [""]


def kernel_tables(rows: list[dict], splits: list[int]) -> list[str]:
    k0 = rows[0]
    out = [f"## The attention call alone: batch {k0['batch']}, {k0['keys']:,} keys, one query per head", "",
           "| rows | bytes read | SDPA ms | SDPA % bandwidth | split-KV ms | split-KV GB/s | split-KV % bandwidth | "
           "max abs diff |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['case']} | {r['bytes_read']:,} | {cell(r.get('sdpa_ms'))} | "
                   f"{cell(r.get('sdpa_pct_bandwidth'), '{:.0f} %')} | {cell(r.get('split_kv_ms'))} | "
                   f"{cell(r.get('split_kv_gbs'), '{:.0f}')} | {cell(r.get('split_kv_pct_bandwidth'), '{:.0f} %')} | "
                   f"{cell(r.get('max_abs_diff'), '{:.1e}')} |")
    if splits and "split_kv_ms" in k0:
        out += ["", "Split count forced (`--kernel-splits`): ms per call", "",
                "| rows | auto | " + " | ".join(f"{n} splits" for n in splits) + " |", "|---|---|" + "---|" * len(splits)]
        out += [f"| {r['case']} | {cell(r.get('split_kv_ms'))} | " + " | ".join(cell(r.get(f"split_kv_s{n}_ms"))
                                                                             for n in splits) + " |" for r in rows]
    return out + [""]
