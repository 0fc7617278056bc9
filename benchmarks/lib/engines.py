"""The engine studies' exports and perplexity; ``engines_vllm``'s runs (:func:`compare`: vLLM / llama.cpp against
transformers and ours), ``engines_vllm_plugin``'s (:func:`one_run`: one KV budget; load, ratios, their spread)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import transformers

from benchmarks.harness.timing import sampled
from kvsplice.convert.engines import gguf_convert, llama_cpp
from kvsplice.convert.engines import vllm as vllm_engine
from kvsplice.report.memory import cache_bytes_formula, measure_cache

PAD = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) of the padded export: the row vLLM's CPU MLA kernel takes
SHAPES = ("ds_mha", "ds_mla", "ds_mla_kvsplice_50", "ds_mla_kvsplice_90")
SCORED, PROMPT, MAX_REPEATS = 96, 8, 20
CELLS = 65536  # llama.cpp's cells when its KV B / token is read: its MiB (2 decimals) ± 0.005 MiB / CELLS = ± 0.08 B
KEY = "median_decode_tok_s"  # the rate compared: the full batch over the median decode step (robust to bursts)
ALL_STEPS = "decode_tok_s"  # the other: tokens over the seconds of every decode step (any batch)
BLOCK = 32  # cache block of standard attention (vLLM's CPU attention takes multiples of 32; MLA gets 16)
SLACK = 2 * BLOCK  # tokens over --mha-seqs sequences in the budget: vLLM's null block, whole blocks


def export(ckpt: Path, out: Path, fmt: str = "auto", pad: tuple = (None, None), tokenizer: bool = True) -> Path:
    """``ckpt`` exported into ``out`` (replaced; ``pad``: DeepSeek-V3 latent, RoPE widths), its report to stderr."""
    from training import export as ex

    with contextlib.redirect_stdout(sys.stderr):
        ex.export(ckpt, out, force=True, tokenizer=tokenizer, fmt=fmt, pad_latent=pad[0], pad_rope=pad[1])
    return out


def ppl(logits, ids: Sequence[int]) -> float:
    """Perplexity of ``ids`` (T,) under next-token ``logits`` (T, V)."""
    lg, t = torch.as_tensor(logits).float(), torch.as_tensor(list(ids))
    return math.exp(torch.nn.functional.cross_entropy(lg[:-1], t[1:]).item())


def logprobs_of(logits: torch.Tensor, ids: Sequence[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for i ≥ 1 from next-token ``logits`` (T, V)."""
    t = torch.as_tensor(list(ids))
    return torch.log_softmax(logits[:-1].double(), -1).gather(1, t[1:, None])[:, 0].tolist()  # (T-1,)


@torch.no_grad()
def reference(folder: Path, ids: Sequence[int], prompt: Sequence[int], new: int):
    """transformers on ``folder`` (fp32): log-probabilities of ``ids``, greedy ``new`` tokens after ``prompt``."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    lp = logprobs_of(ref(torch.tensor([list(ids)])).logits[0], ids)
    if not new:
        return lp, []
    g = ref.generate(torch.tensor([list(prompt)]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return lp, g[0, len(prompt):].tolist()  # (prompt + new,) -> the new tokens


@torch.no_grad()
def compare(hf_dir: Path, ids: Sequence[int], prompt: Sequence[int], *, new: int, max_model_len: int,
            ours_logits: torch.Tensor, ours_greedy: list[int], ref_dir: Optional[Path] = None,
            kernel_rope: bool = True, engines: Sequence[str] = ("vllm",)) -> dict[str, Any]:
    """``engines`` (vLLM on the padded export ``hf_dir``, llama.cpp (f16 KV) on ``ref_dir`` by its converter) against
    transformers on ``ref_dir`` (unpadded; default ``hf_dir``) and ours (``ours_logits`` (T, V), ``ours_greedy``)."""
    ref_dir = ref_dir or hf_dir
    ref_lp, ref_greedy = reference(ref_dir, ids, prompt, new)
    lp, greedy, out = {"transformers": ref_lp}, {"transformers": ref_greedy, "ours": list(ours_greedy)}, {}
    if ref_dir != hf_dir and "vllm" in engines:
        lp["transformers_padded"] = reference(hf_dir, ids, prompt, 0)[0]
    lp["ours"] = logprobs_of(ours_logits, ids)
    if "llama.cpp" in engines:
        gguf_convert.hf_to_gguf(ref_dir, ref_dir.parent / "model.gguf")
        with llama_cpp.LlamaCppModel(ref_dir.parent / "model.gguf", n_ctx=CELLS, n_batch=len(ids) + new + 8) as lm:
            lp["llama.cpp"] = logprobs_of(torch.as_tensor(lm.logits(list(ids))), ids)
            greedy["llama.cpp"] = lm.greedy(list(prompt), new)
            out["llama_cpp"] = {"kv_bytes_per_token_f16": lm.kv_bytes_per_token, "rounding": 0.005 * 2**20 / CELLS}
    runs, seconds = {}, {}
    ropes = [("vllm", True), ("vllm_cpu_rope_op", False)][: 1 + kernel_rope] if "vllm" in engines else []
    for name, native in ropes:  # vLLM with its RoPE as PyTorch code, then with its CPU RoPE op
        t0 = time.perf_counter()
        runs[name] = vllm_engine.run(hf_dir, prompt=prompt, new=new, score=ids, max_model_len=max_model_len,
                                     native_rope=native)
        seconds[name] = time.perf_counter() - t0
        lp[name], greedy[name] = [float(v) for v in runs[name].logprobs[1:]], runs[name].greedy
    if runs:
        v, la = runs["vllm"], runs["vllm"].layers[0]
        out["vllm"] = {"version": v.version, "backend": v.backend, "prefill_backend": la["prefill_backend"],
                       "kv_cache_row": la["kv_cache_shape"][-1], "kv_cache_dtype": la["kv_cache_dtype"],
                       "block_size": la["kv_cache_shape"][1], "layers": len(v.layers),
                       "kv_bytes_per_token": v.kv_bytes_per_token, "kv_cache_tokens": v.kv_cache_tokens,
                       "seconds": seconds}
    diff = {k: [abs(a - b) for a, b in zip(x, lp["transformers"])] for k, x in lp.items() if k != "transformers"}
    first = {k: next((i for i, e in enumerate(d) if e > 1e-3), None) for k, d in diff.items()}  # 0-based position
    return {"tokens": len(ids), "new": new, "perplexity": {k: math.exp(-sum(x) / len(x)) for k, x in lp.items()},
            "max_abs_logprob_diff_vs_transformers": {k: max(d) for k, d in diff.items()},
            "first_position_off_by_1e-3": first,  # whose next-token prediction is off
            "greedy": greedy,
            "greedy_equal_to_transformers": {k: g == greedy["transformers"] for k, g in greedy.items()}, **out}


@torch.no_grad()
def trained_in_engines(ckpt: Path, text: str, *, tokens: int = 96, new: int = 32, work: Optional[Path] = None,
            kernel_rope: bool = True, engines: Sequence[str] = ("vllm",)) -> dict[str, Any]:
    """A trained checkpoint in :func:`compare` (``kernel_rope``: vLLM's RoPE op too), with our f16 cache's bytes."""
    from models.checkpoint import load_gpt_checkpoint
    from training.export import export_kind

    model, cfg, meta = load_gpt_checkpoint(ckpt)
    model.eval()
    work = Path(work or tempfile.mkdtemp(prefix="engines_vllm_"))
    ids = transformers.AutoTokenizer.from_pretrained(export(ckpt, work / "hf"))(text)["input_ids"]
    ids = ids[: min(tokens, cfg.block_size)]
    padded = export(ckpt, work / "hf_padded", "deepseek_v3", PAD) if "vllm" in engines else work / "hf"
    prompt = ids[:8]
    g_ours = model.generate(torch.tensor([prompt]), new, temperature=0.0)[0, 8:].tolist()
    out = compare(padded, ids, prompt, new=new, max_model_len=cfg.block_size, ours_logits=model(torch.tensor([ids]))[0],
                  ours_greedy=g_ours, ref_dir=work / "hf", kernel_rope=kernel_rope, engines=engines)
    half = copy.deepcopy(model).half()
    cache = half.new_cache(1, capacity=len(ids))
    half(torch.tensor([ids]), cache=cache)
    f16 = {"ours": measure_cache(cache).live_bytes / len(ids), "formula": cache_bytes_formula(cfg, 1, torch.float16)}
    return {"model": {"ckpt": str(ckpt), "variant": cfg.variant, "trained_steps": meta.get("global_step"),
                      "format": export_kind(cfg), "cached_latent": cfg.d_cached_latent, "rope": cfg.qk_rope_head_dim,
                      "layers": cfg.n_layer, "padded_to": list(PAD) if "vllm" in engines else None,
                      "kv_bytes_per_token_unpadded_fp32": cfg.n_layer * cfg.cache_dim * 4,
                      "kv_bytes_per_token_f16": f16}, **out}


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
    ds = ["--model", str(native), "--format", "deepseek_v3", "--force", "--out"]
    with contextlib.redirect_stdout(sys.stderr):  # the conversions' own reports: not this command's JSON
        for argv in (["--model", str(gguf), "--calib", str(calib), "--calib-tokens", str(calib_tokens), "--d-latent",
                      str(d_latent), "--rope-layout", "shared", "--rope-dims", "all", "--no-progress", "--force",
                      "--out", str(native)], ds + [str(unpadded)],
                     ds + [str(padded), "--pad-latent", str(PAD[0]), "--pad-rope", str(PAD[1])]):
            if to_mla.main(argv) != 0:
                raise RuntimeError(f"to_mla {' '.join(argv)} failed")
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


def measure(name: str, folder: Path, ref_dir: Path, cfg, *, budget: int, context: int, new: int, plugin: bool,
            row_bytes: int) -> dict[str, Any]:
    """One vLLM engine on ``folder`` against transformers on ``ref_dir`` (``error``: a budget under one sequence)."""
    ids = torch.randint(0, cfg.vocab_size, (SCORED,), generator=torch.Generator().manual_seed(1)).tolist()
    lp, greedy = reference(ref_dir, ids, ids[:PROMPT], new)
    t0, formula = time.perf_counter(), budget // row_bytes
    row = {"model": name, "plugin": plugin, "kv_budget": budget, "bytes_per_token_formula": row_bytes,
           "cache_tokens_formula": formula}
    if formula < context + 16:  # less than one full-length sequence (and vLLM's null block): vLLM refuses to start
        return dict(row, row=None, error=f"the budget holds {formula} tokens, under one {context}-token sequence: "
                    "vLLM does not start")
    run = vllm_engine.run(folder, prompt=ids[:PROMPT], new=new, score=ids, others=[ids[40:90], ids[3:20], ids[:5]],
                          max_model_len=context, kv_cache_bytes=budget, plugin=plugin, max_num_seqs=1024,
                          block_size=BLOCK, throughput={"seqs": 0, "prompt": context - new, "new": new}, timeout=3600)
    la = run.layers[0]
    return {**row, "backend": la["backend"], "decode_kernel": la["kernel"], "row": la["kv_cache_shape"][-1],
            "bytes_per_token": run.kv_bytes_per_token, "cache_tokens_vllm": run.cache_tokens,
            "greedy_equal": run.greedy == greedy,
            "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(run.logprobs[1:], lp)),
            "throughput": run.throughput, "seconds": time.perf_counter() - t0, "vllm": run.version}


def models(shapes: Sequence[str], trained: Sequence[Path], mha_seqs: int, context: int):
    """``(name, cfg, model, budget)``: the 124M ``shapes`` (seed 0), the ``trained``; a group's budget ``mha_seqs``
    full-length sequences of its standard attention (+ :data:`SLACK` tokens)."""
    from models import GPT
    from models.checkpoint import load_gpt_checkpoint
    from models.config import GPTConfig

    budget = (mha_seqs * context + SLACK) * cache_bytes_formula(GPTConfig.from_name("ds_mha"), 1, torch.float32)
    for name in shapes:
        torch.manual_seed(0)
        cfg = GPTConfig.from_name(name)
        yield f"{name} (124M shapes, random)", cfg, GPT(cfg).eval(), budget
    for ckpt in trained:
        model, cfg, meta = load_gpt_checkpoint(ckpt)
        mha_bytes = cfg.n_layer * 2 * cfg.d_model * 4  # the same shapes' standard attention: K and V of d_model
        yield (f"{cfg.variant} (tiny, {meta.get('global_step')} steps)", cfg, model.eval(),
               (mha_seqs * min(context, cfg.block_size) + SLACK) * mha_bytes)


def one_run(shapes, trained, *, mha_seqs: int, context: int, new: int, previous=lambda **key: None):
    """Every model once in vLLM (KVSplice-90 also padded, no plugin); ``previous(model=, plugin=)``: a kept row."""
    from models.checkpoint import save_model

    work = Path(tempfile.mkdtemp(prefix="vllm_plugin_bench_"))
    try:
        for name, cfg, model, budget in models(shapes, trained, mha_seqs, context):
            padded, ckpt, ref = cfg.attention == "mla" and "kvsplice_90" in cfg.variant, None, None
            for plugin, pad in ((True, None), (False, PAD))[: 1 + padded]:
                row = previous(model=name, plugin=plugin)
                if row is None:
                    ckpt = ckpt or save_model(model, work / "x.ckpt")  # random weights: exported without a tokenizer
                    ref = ref or export(ckpt, work / "x", tokenizer=False)
                    folder = export(ckpt, work / "x_padded", pad=pad, tokenizer=False) if pad else ref
                    row_bytes = cache_bytes_formula(cfg, 1, torch.float32) if plugin else cfg.n_layer * sum(PAD) * 4
                    row = measure(name, folder, ref, cfg, budget=budget, context=min(context, cfg.block_size),
                                  new=new, plugin=plugin, row_bytes=row_bytes)
                yield row
            del model
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def sampled_load(every: float = 5.0):
    """The 1-minute load average every ``every`` s in the block (a shared CPU): a dict of its mean, min, max, count."""
    out = {}
    with sampled(lambda: os.getloadavg()[0], every) as x:
        yield out
    out.update(mean=round(statistics.fmean(x), 2), min=round(min(x), 2), max=round(max(x), 2), n=len(x))


def ratios(rows: list[dict[str, Any]], key: str = KEY) -> dict[str, float]:
    """Each model's decode tokens/s (``key``) over its group's (124M, tiny) standard attention."""
    out = {}
    for group in ("124M", "tiny"):
        tok_s = {r["model"] + ("" if r["plugin"] else ", padded"): (r.get("throughput") or {}).get(key)
                 for r in rows if group in r["model"]}
        mha = {m: v for m, v in tok_s.items() if m.startswith(("ds_mha", "mha"))}
        base = next(iter(mha.values()), None)
        out.update({f"{m} vs standard attention": v / base for m, v in tok_s.items() if base and v and m not in mha})
    return out


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements (and the values, in run order)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": list(values)}


def repeat_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per ratio: its spread at the median decode step and over all steps, over the runs (``runs``) that have it."""
    per = [(ratios(r["rows"]), ratios(r["rows"], ALL_STEPS)) for r in runs]
    out = []
    for k in dict.fromkeys(k for m, _ in per for k in m):
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
