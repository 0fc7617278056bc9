"""The runs of ``benchmarks/engines_vllm.py``: a DeepSeek-V3 export in vLLM (CPU) against transformers and ours on
the same tokens (per-token log-probabilities, perplexity, greedy tokens, the backend and KV row vLLM picked), for a
trained checkpoint (:func:`trained`) or the shared SmolLM2 converted to MLA (:func:`smollm2`)."""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import transformers

from benchmarks.lib.engines import export, trained as trained_export
from kvsplice.convert.engines import vllm as vllm_engine

PAD = (512, 64)
"""(kv_lora_rank, qk_rope_head_dim) of the padded export: the row vLLM's CPU MLA kernel takes."""


def logprobs_of(logits: torch.Tensor, ids: Sequence[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for i ≥ 1 from next-token ``logits`` (T, V)."""
    t = torch.as_tensor(list(ids))
    return torch.log_softmax(logits[:-1].double(), -1).gather(1, t[1:, None])[:, 0].tolist()  # (T-1,)


@torch.no_grad()
def reference(folder: Path, ids: Sequence[int], prompt: Sequence[int], new: int):
    """transformers on ``folder`` (fp32): its log-probabilities of ``ids`` and its greedy ``new`` tokens after
    ``prompt`` (none for ``new`` 0)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    lp = logprobs_of(ref(torch.tensor([list(ids)])).logits[0], ids)
    if not new:
        return lp, []
    g = ref.generate(torch.tensor([list(prompt)]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return lp, g[0, len(prompt):].tolist()  # (prompt + new,) -> the new tokens


@torch.no_grad()
def compare(hf_dir: Path, ids: Sequence[int], prompt: Sequence[int], *, new: int, max_model_len: int,
            ours_logits: Optional[torch.Tensor] = None, ours_greedy: Optional[list[int]] = None,
            ref_dir: Optional[Path] = None, kernel_rope: bool = True) -> dict[str, Any]:
    """vLLM on the (padded) export ``hf_dir`` against transformers on ``ref_dir`` (the unpadded export; default
    ``hf_dir``) and ours (``ours_logits`` (T, V) on ``ids``, ``ours_greedy`` after ``prompt``), on ``ids``."""
    ref_lp, ref_greedy = reference(ref_dir or hf_dir, ids, prompt, new)
    lp, greedy = {"transformers": ref_lp}, {"transformers": ref_greedy}
    if ref_dir is not None:
        lp["transformers_padded"] = reference(hf_dir, ids, prompt, 0)[0]
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
    return {"tokens": len(ids), "new": new, "perplexity": {k: math.exp(-sum(x) / len(x)) for k, x in lp.items()},
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
    model, cfg, meta, work, ids = trained_export(ckpt, text, tokens, work, "engines_vllm_")
    export(ckpt, work / "hf_padded", "deepseek_v3", PAD)
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
