"""Online frequent-directions bases vs global post-RoPE bases at matched cache bytes, on stories260K + TinyStories.

    python -m benchmarks.fd_online_stories260k     # → results/fd_online_stories260k.json + .md (≈ 5–8 min, 1 CPU)

Text: the first ``--windows`` × 512 tokens of the TinyStories validation sample; global bases (``kq``, ``gqa-sum``
post-RoPE at R = 2/4/6, ``ksvd`` post and ``kq`` pre for reference) fitted on the first ``--calib-tokens`` of the
train sample. fd-online: :class:`kvsplice.online.method.OnlineDecoder` (no calibration), the YAML's ``configs`` per
budget; bytes = coefficients + bases measured from the cache after a window (FD sketches apart); *matched*: ≤ the
global rank-R cache's bytes. Teacher-forced attention errors and bound slack on the first window
(:mod:`kvsplice.online.diagnostics`); with ``max_chunks`` a window is decoded token by token, else in one prefill.
"""

from __future__ import annotations

import time

from benchmarks.harness.paths import CALIB, EVAL, STORIES
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study
from benchmarks.lib.bases_report import fd_summary, summary
from benchmarks.lib.stories import calibration_ids, load_stories, windows as text_windows

from kvsplice.decode import Decoder, DenseKV, perplexity
from kvsplice.lowrank.method import LowRank
from kvsplice.lowrank.calibrate import calibrate, calibration_batches
from kvsplice.lowrank.fits import fit_bases
from kvsplice.lowrank.diagnostics import bases_diagnostics
from kvsplice.online.diagnostics import online_qkv_diagnostics
from kvsplice.online.method import OnlineDecoder

RANKS = (2, 4, 6)
FD_CONFIGS: dict[int, list[dict]] = load_study("fd_online_stories260k")["configs"]  # per global rank R

# an fd-online option shown in a configuration's label → (its short name, the default left out)
SHORT = {"tau_k": ("τ_k", None), "min_chunk_len": ("m", 1), "max_chunks": ("J_max", None), "fd_decay": ("γ", 1.0)}


def label(kw: dict) -> str:
    rel = lambda k: " rel" if k == "tau_k" and kw.get("relative") else ""  # noqa: E731
    return ", ".join([f"r={kw['rank_k']}/{kw['rank_v']}", f"L={kw['max_chunk_len']}",
                      *(f"{n}={kw[k]}{rel(k)}" for k, (n, d) in SHORT.items() if kw.get(k, d) not in (d, 0))])


def options(p) -> None:
    p.add_argument("--windows", type=int, help="eval windows of 512 tokens")
    p.add_argument("--calib-tokens", dest="calib_tokens", type=int, help="calibration tokens")
    p.add_argument("--ranks", type=int, nargs="+", choices=RANKS, help="global ranks R (budgets) compared")


def rows(run):
    loaded = load_stories()
    model, cfg = loaded.model, loaded.model.config
    windows, _ = text_windows(loaded, EVAL, 512, run["windows"], split="validation")
    cal = calibration_ids(loaded, run["calib_tokens"])
    n_win, t = windows.shape
    L, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    run.notes.update(model={"source": str(STORIES / "stories260K.bin"), "n_layer": L, "n_head": cfg.num_attention_heads,
                            "n_kv_head": hkv, "head_dim": d},
                     eval={"source": str(EVAL), "windows": n_win, "seq_len": t, "tokens": n_win * t,
                           "diagnostics_windows": 1},
                     calibration={"source": str(CALIB), "tokens": int(cal.numel())},
                     full_ppl=perplexity(Decoder(model, DenseKV()), windows))
    run.say(f"stories260K: {L} layers, {cfg.num_attention_heads}/{hkv} heads, d={d}; eval {n_win}×{t} tokens, "
            f"calibration {cal.numel()} tokens")
    stats = {rope: calibrate(model, calibration_batches(cal, 512, 8), rope=rope, progress=False)
             for rope in ("post", "pre")}
    for r in run["ranks"]:  # global bases
        for method, rope in (("kq", "post"), ("gqa-sum", "post"), ("ksvd", "post"), ("kq", "pre")):
            bases = fit_bases(stats[rope], method, rank=r)
            t0 = time.perf_counter()
            ppl = perplexity(Decoder(model, LowRank(bases)), windows)
            diag = bases_diagnostics(model, bases, windows[:1])
            row = {"budget_rank": r, "kind": "global", "method": f"{method} ({rope}-RoPE)", "rope": rope,
                   "config": {"method": method, "rank": r}, "ppl": ppl, "bytes": bases.elements_per_token() * t * 4,
                   "sketch_bytes": 0, "reference_only": (method, rope) not in (("kq", "post"), ("gqa-sum", "post")),
                   "seconds": time.perf_counter() - t0, **summary(diag), "layers": diag}
            run.say(f"R={r} {row['method']:<18} ppl {ppl:8.3f}  rel_out {row['rel_out_mean']:.3f}")
            yield row
    for r in run["ranks"]:  # fd-online
        budget = 2 * r * L * hkv * t * 4
        for kw in FD_CONFIGS[r]:
            t0 = time.perf_counter()
            dec = OnlineDecoder(model, **kw)
            chunk = 1 if kw.get("max_chunks") else None
            ppl = dec.perplexity(windows, chunk_size=chunk)
            cache = dec.new_cache(1)
            dec(windows[:1], cache)
            br = cache.nbytes_breakdown()
            nbytes = sum(br.values()) - br["sketch"]
            diag = online_qkv_diagnostics(model, windows[:1], **kw)
            row = {"budget_rank": r, "kind": "fd-online", "method": "fd-online", "rope": "post", "config": kw,
                   "label": label(kw), "ppl": ppl, "bytes": nbytes, "sketch_bytes": br["sketch"],
                   "bytes_breakdown": br, "budget_bytes": budget, "matched": nbytes <= budget,
                   "decode": "token by token" if chunk == 1 else "prefill (= token by token)",
                   "seconds": time.perf_counter() - t0, **summary(diag), "layers": diag}
            run.say(f"R={r} fd-online {label(kw):<55} ppl {ppl:8.3f}  bytes {nbytes / budget:.3f}×  "
                    f"J {row['chunks_max']}  rel_out {row['rel_out_mean']:.3f}  {row['seconds']:.0f}s")
            yield row


STUDY = Study("fd_online_stories260k", __doc__, rows, options=options,
              summary=lambda run, rows: fd_summary(run.notes, rows),
              bounds={"windows": (1, 4096), "calib_tokens": (512, 1 << 22)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
