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


import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import transformers

from benchmarks.harness.options import UsageError, add_json, add_out, command, parser
from benchmarks.harness.paths import CALIB, EVAL, SMOLLM2, TINYSTORIES
from benchmarks.lib.engines import export, report
from kvsplice.convert.engines import vllm as vllm_engine
from kvsplice.io.files import output_file
from kvsplice.io.write import write_json
from models.checkpoint import atomic_write

PAD = (512, 64)
"""(kv_lora_rank, qk_rope_head_dim) of the padded export: the row vLLM's CPU MLA kernel takes."""


def logprobs_of(logits: torch.Tensor, ids: Sequence[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for i ≥ 1 from next-token ``logits`` (T, V)."""
    t = torch.as_tensor(list(ids))
    return torch.log_softmax(logits[:-1].double(), -1).gather(1, t[1:, None])[:, 0].tolist()  # (T-1,)


def ppl(lp: Sequence[float]) -> float:
    return math.exp(-sum(lp) / len(lp))


@torch.no_grad()
def compare(hf_dir: Path, ids: Sequence[int], prompt: Sequence[int], *, new: int, max_model_len: int,
            ours_logits: Optional[torch.Tensor] = None, ours_greedy: Optional[list[int]] = None,
            ref_dir: Optional[Path] = None, kernel_rope: bool = True) -> dict[str, Any]:
    """vLLM on the (padded) export ``hf_dir`` against transformers on ``ref_dir`` (the unpadded export; default
    ``hf_dir``) and ours (``ours_logits`` (T, V) on ``ids``, ``ours_greedy`` after ``prompt``), on ``ids``."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir or hf_dir, dtype=torch.float32).eval()
    x = torch.tensor([list(ids)])  # (1, T)
    lp = {"transformers": logprobs_of(ref(x).logits[0], ids)}
    if ref_dir is not None:
        padded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        lp["transformers_padded"] = logprobs_of(padded(x).logits[0], ids)
    p = torch.tensor([list(prompt)])
    g_ref = ref.generate(p, max_new_tokens=new, min_new_tokens=new, do_sample=False)  # (1, prompt + new)
    greedy = {"transformers": g_ref[0, len(prompt):].tolist()}
    if ours_logits is not None:
        lp["ours"] = logprobs_of(ours_logits, ids)
    if ours_greedy is not None:
        greedy["ours"] = list(ours_greedy)
    runs, seconds = {}, {}
    for name, native in (("vllm", True), ("vllm_cpu_rope_op", False))[: 2 if kernel_rope else 1]:
        t0 = time.perf_counter()
        runs[name] = vllm_engine.run(hf_dir, prompt=prompt, new=new, score=ids, max_model_len=max_model_len,
                                     native_rope=native)
        seconds[name] = time.perf_counter() - t0
        lp[name], greedy[name] = [float(v) for v in runs[name].logprobs[1:]], runs[name].greedy
    v = runs["vllm"]
    la = v.layers[0]
    d_lp = {k: max(abs(a - b) for a, b in zip(lp[k], lp["transformers"])) for k in lp if k != "transformers"}
    first_bad = {k: next((i for i, (a, b) in enumerate(zip(lp[k], lp["transformers"])) if abs(a - b) > 1e-3), None)
                 for k in lp if k != "transformers"}
    return {"tokens": len(ids), "new": new, "perplexity": {k: ppl(x) for k, x in lp.items()},
            "max_abs_logprob_diff_vs_transformers": d_lp,
            "first_position_off_by_1e-3": first_bad,  # 0-based position whose next-token prediction is off
            "greedy": greedy,
            "greedy_equal_to_transformers": {k: g == greedy["transformers"] for k, g in greedy.items()},
            "vllm": {"version": v.version, "backend": v.backend, "prefill_backend": la["prefill_backend"],
                     "kv_cache_row": la["kv_cache_shape"][-1], "kv_cache_dtype": la["kv_cache_dtype"],
                     "block_size": la["kv_cache_shape"][1], "layers": len(v.layers),
                     "kv_bytes_per_token": v.kv_bytes_per_token, "kv_cache_tokens": v.kv_cache_tokens,
                     "seconds": seconds}}


@torch.no_grad()
def trained(ckpt: Path, text: str, *, tokens: int = 96, new: int = 32, work: Optional[Path] = None,
            kernel_rope: bool = True) -> dict[str, Any]:
    """A trained DS-layout checkpoint: ours, transformers (unpadded export), vLLM (export padded to 512 + 64;
    ``kernel_rope``: also with vLLM's CPU RoPE op)."""
    from models.checkpoint import load_gpt_checkpoint

    model, cfg, meta = load_gpt_checkpoint(ckpt)
    model.eval()
    work = Path(work or tempfile.mkdtemp(prefix="engines_vllm_"))
    export(ckpt, work / "hf", "deepseek_v3")
    export(ckpt, work / "hf_padded", "deepseek_v3", PAD)
    tok = transformers.AutoTokenizer.from_pretrained(work / "hf")
    ids = tok(text)["input_ids"][: min(tokens, cfg.block_size)]
    prompt = ids[:8]
    g_ours = model.generate(torch.tensor([prompt]), new, temperature=0.0)[0, 8:].tolist()
    out = compare(work / "hf_padded", ids, prompt, new=new, max_model_len=cfg.block_size,
                  ours_logits=model(torch.tensor([ids]))[0], ours_greedy=g_ours, ref_dir=work / "hf",
                  kernel_rope=kernel_rope)
    return {"model": {"ckpt": str(ckpt), "variant": cfg.variant, "trained_steps": meta.get("global_step"),
                      "cached_latent": cfg.d_cached_latent,
                      "rope": cfg.qk_rope_head_dim, "layers": cfg.n_layer, "padded_to": list(PAD),
                      "kv_bytes_per_token_unpadded_fp32": cfg.n_layer * cfg.cache_dim * 4}, **out}


@torch.no_grad()
def smollm2(*, gguf: Path, calib: Path, text: Path, calib_tokens: int = 8192, d_latent: int = 128, tokens: int = 256,
            new: int = 32, work: Optional[Path] = None) -> dict[str, Any]:
    """SmolLM2 converted (shared RoPE, every frequency) and exported padded to 512 + 64."""
    from kvsplice.cli import to_mla
    from kvsplice.decode import Decoder
    from kvsplice.loading import load_model

    work = Path(work or tempfile.mkdtemp(prefix="engines_vllm_smol_"))
    native, unpadded, padded = work / "mla", work / "ds", work / "ds_padded"
    t0 = time.perf_counter()
    common = ["--model", str(gguf), "--calib", str(calib), "--calib-tokens", str(calib_tokens), "--d-latent",
              str(d_latent), "--rope-layout", "shared", "--rope-dims", "all", "--no-progress", "--force"]
    with contextlib.redirect_stdout(sys.stderr):  # the conversions' own reports: not this command's JSON
        if to_mla.main(common + ["--out", str(native)]) != 0:
            raise RuntimeError("to_mla failed")
        for out, pad in ((unpadded, []), (padded, ["--pad-latent", str(PAD[0]), "--pad-rope", str(PAD[1])])):
            if to_mla.main(["--model", str(native), "--format", "deepseek_v3", *pad, "--out", str(out), "--force"]):
                raise RuntimeError(f"to_mla --format deepseek_v3 {' '.join(pad)} failed")
    convert_s = time.perf_counter() - t0
    mla = load_model(str(native)).model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(padded)
    ids = tok(text.read_text(encoding="utf-8")[:20000])["input_ids"][:tokens]
    prompt = tok("Once upon a time")["input_ids"]
    g_ours = Decoder(mla).generate(torch.tensor([prompt]), new)[0, len(prompt):].tolist()
    out = compare(padded, ids, prompt, new=new, max_model_len=512, ours_logits=mla(torch.tensor([ids]))[0],
                  ours_greedy=g_ours, ref_dir=unpadded)
    c = mla.cfg
    return {"model": {"source": str(gguf), "d_latent": c.d_latent, "rope": c.rope_dims, "layers": c.n_layer,
                      "padded_to": list(PAD), "calibration": f"{calib_tokens} tokens of {calib.name}",
                      "text": f"first {tokens} tokens of {text.name}", "convert_seconds": convert_s,
                      "kv_bytes_per_token_unpadded_fp32": c.n_layer * c.cache_dim * 4,
                      "greedy_text": {"transformers": tok.decode(out["greedy"]["transformers"])}}, **out}


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
