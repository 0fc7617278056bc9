"""DeepSeek-V3 exports in vLLM (CPU, its CPU_MLA backend) beside our model and transformers: greedy tokens,
per-token log-probabilities, perplexity, the backend vLLM picked and the KV cache row it allocated.

    python -m benchmarks.engines_vllm --ckpt checkpoints/tiny_ds_mla_kvsplice_90/last.ckpt \\
        --text ../shared/data/tinystories/yuninxia_moe-routing-bench__tinystories_val.txt --json trained.json
    python -m benchmarks.engines_vllm --smollm2 --json smol.json
    python -m benchmarks.engines_vllm --report trained.json smol.json \\
        --out results/engines_vllm      # results/engines_vllm.{json,md} from the runs' JSON

``--ckpt``: a trained ``deepseek_v3``-layout MLA / KVSplice checkpoint, exported twice with ``training.export``:
unpadded (transformers' reference) and padded to 512 + 64 (``--pad-latent 512 --pad-rope 64``, the only row vLLM's
CPU MLA kernel takes). ``--smollm2``: the shared SmolLM2-135M GGUF converted (``to_mla``, latent 128 + 64 shared RoPE,
8,192 calibration tokens of TinyStoriesV2) and exported unpadded (transformers' reference) and padded to 512 + 64.
Each export runs in vLLM twice: with vLLM's RoPE as PyTorch code (the runner's default) and with its CPU C++ RoPE op
(``native_rope=False``), which mis-indexes MLA's strided query / key slices (:mod:`kvsplice.convert.engines.vllm_worker`).
JSON on stdout (``--json`` also writes it). Needs vLLM's venv (``$KVSPLICE_VLLM_PYTHON`` or ``build/vllm-venv``; docs/conversion.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from benchmarks.harness.options import UsageError, add_json, add_out, command, parser
from benchmarks.harness.paths import CALIB, EVAL, SMOLLM2, TINYSTORIES
from benchmarks.lib.engines import report
from benchmarks.lib.vllm_runs import PAD, compare, smollm2, trained  # noqa: F401  (the tests call them here)
from kvsplice.convert.engines import vllm as vllm_engine
from kvsplice.io.files import output_file
from kvsplice.io.write import write_json
from models.checkpoint import atomic_write


ROWS = (("ours", "ours (cached decode / full forward)"), ("transformers", "transformers, unpadded export"),
        ("transformers_padded", "transformers, padded export"), ("vllm", "vLLM, padded export (PyTorch RoPE)"),
        ("vllm_cpu_rope_op", "vLLM, padded export (its CPU RoPE op)"))


def markdown(runs: dict[str, dict[str, Any]]) -> str:
    """results/engines_vllm.md from the runs' JSON (``{name: run}``)."""
    out = ["# DeepSeek-V3 exports in vLLM (CPU) beside ours and transformers", "",
           "Made by `benchmarks/engines_vllm.py` (commands below); fp32 weights and KV cache, greedy decoding, "
           "2-core CPU shared with other jobs. Per-token log-probabilities are compared position by position.", ""]
    for name, r in runs.items():
        m, v = r["model"], r["vllm"]
        out += [f"## {name}", "", f"`{r['command']}`", "",
                f"Model: {json.dumps({k: m[k] for k in m if k != 'greedy_text'})}", "",
                f"vLLM {v['version']}: backend **{v['backend']}** (prefill {v['prefill_backend']}), KV cache row "
                f"{v['kv_cache_row']} ({v['kv_cache_dtype']}, blocks of {v['block_size']}) × {v['layers']} layers = "
                f"**{v['kv_bytes_per_token']:,} B per token** (the unpadded row would be "
                f"{m['kv_bytes_per_token_unpadded_fp32']:,} B in fp32); {v['kv_cache_tokens']:,} tokens in 1 GiB; "
                f"engine start + runs: " + ", ".join(f"{k} {t:.0f} s" for k, t in v["seconds"].items()) + ".", "",
                f"| engine | perplexity ({r['tokens']} tokens) | max abs Δ log-prob vs transformers | first position "
                f"(0-based) whose prediction is off by > 1e-3 | greedy {r['new']} == transformers |",
                "|---|---|---|---|---|"]
        for key, label in ROWS:
            if key not in r["perplexity"]:
                continue
            d = r["max_abs_logprob_diff_vs_transformers"].get(key)
            first = r["first_position_off_by_1e-3"].get(key)
            same = r["greedy_equal_to_transformers"].get(key)
            out.append(f"| {label} | {r['perplexity'][key]:.4f} | {'—' if d is None else f'{d:.2e}'} | "
                       f"{'—' if first is None else first} | {'—' if same is None else 'yes' if same else 'no'} |")
        g = r["greedy"]
        out += ["", f"Greedy tokens: transformers {g['transformers']}" + (
            f"; vLLM with its CPU RoPE op {g['vllm_cpu_rope_op']}" if "vllm_cpu_rope_op" in g else ""), ""]
        if "greedy_text" in m:
            out += [f"transformers' text: \"{m['greedy_text']['transformers']}\"", ""]
    return "\n".join(out)


@command
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = parser(__file__, __doc__, raw=True)
    ap.add_argument("--ckpt", type=Path, help="a trained deepseek_v3-layout MLA / KVSplice checkpoint")
    ap.add_argument("--text", type=Path, default=EVAL)
    ap.add_argument("--smollm2", action="store_true", help="convert + export the shared SmolLM2 GGUF instead")
    ap.add_argument("--tokens", type=int, default=None, help="scored tokens (default: 96 trained, 256 SmolLM2)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--work", type=Path, default=None)
    add_json(ap)
    ap.add_argument("--report", type=Path, nargs="+", help="render the runs' JSON files into --out .json / .md")
    add_out(ap, help="with --report: the output prefix (results/engines_vllm)")
    a = ap.parse_args(argv)
    if a.report:
        why = "--report needs --out PREFIX" if not a.out else next(
            (f"--report {p}: no such file" for p in a.report if not p.is_file()), None)
        if why:
            raise UsageError(why)
        output_file(a.out.with_suffix(".json"), force=True, option="--out", inputs={"--report": a.report})
        runs = {}
        for path in a.report:
            r = json.loads(path.read_text(encoding="utf-8"))
            runs[f"trained {r['model']['variant']}" if "ckpt" in r["model"] else "SmolLM2-135M converted"] = r
        write_json(runs, a.out.with_suffix(".json"))
        atomic_write(a.out.with_suffix(".md"), lambda tmp: tmp.write_text(markdown(runs) + "\n", encoding="utf-8"))
        return 0
    why = vllm_engine.missing()
    if not why and not (a.ckpt or a.smollm2):
        why = "give --ckpt CKPT or --smollm2"
    if not why and a.ckpt and not a.ckpt.is_file():
        why = f"--ckpt {a.ckpt}: no such file"
    if not why and not a.text.is_file():
        why = f"--text {a.text}: no such file"
    if why:
        raise UsageError(why)
    if a.json:  # the report never replaces an input, checked before the run
        output_file(a.json, force=True, option="--json", inputs={"--ckpt": a.ckpt, "--text": a.text})
    run: Callable[[], dict[str, Any]]
    if a.smollm2:
        run = lambda: smollm2(gguf=SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf",  # noqa: E731
                              calib=TINYSTORIES / "mines-opt-ml_decoding-gpt__tinystories_10k.txt",
                              text=CALIB, tokens=a.tokens or 256, new=a.new, work=a.work)
    else:
        run = lambda: trained(a.ckpt, a.text.read_text(encoding="utf-8"), tokens=a.tokens or 96,  # noqa: E731
                              new=a.new, work=a.work)
    return report(__file__, argv, run(), a.json)


if __name__ == "__main__":
    raise SystemExit(main())
