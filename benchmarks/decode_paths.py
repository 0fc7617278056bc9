"""Per-token decode time of every post-training decode path on stories260K: one JSON line, path -> median thread-CPU
ms per decode step at a fixed context (the cache rolled back after each step; fd-online keeps growing).

    python benchmarks/decode_paths.py MODEL_DIR [CTX [REPEATS]]      # MODEL_DIR from python -m kvsplice.convert_llama2c

Used to check that a refactor kept every path's speed: run it alternately in two checkouts
(``PYTHONPATH=<checkout> python ...``) and compare medians; the script also runs on the earlier APIs — the
``CoefficientDecoder`` one (before the method core, commit 9721567) and the pre-decoder one (commit 8e9582c) — which
it detects.
"""
import json
import statistics
import sys
import time

import torch
torch.set_num_threads(1)
import transformers
model = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1]).eval()
import importlib.util

if importlib.util.find_spec("kvsplice.core") is not None:  # the method core
    from kvsplice.decode import Decoder, DenseKV
    from kvsplice.lowrank.calibrate import calibrate
    from kvsplice.lowrank.fits import fit_bases
    from kvsplice.lowrank.method import LowRank
    from kvsplice.online.method import OnlineDecoder
    from kvsplice.select.method import TokenSelectionDecoder
    from kvsplice.select.selectors import UniformSelector

    def CoefficientDecoder(model, bases=None, impl="absorb"):  # noqa: N802  (the earlier APIs' name)
        return Decoder(model, DenseKV() if bases is None else LowRank(bases, impl=impl))
    api = "core"
elif importlib.util.find_spec("kvsplice.lowrank") is not None:  # one decoder, before the method core
    from kvsplice.lowrank.calibrate import calibrate
    from kvsplice.lowrank.fits import fit_bases
    from kvsplice.lowrank.method import CoefficientDecoder
    from kvsplice.online.method import OnlineDecoder
    from kvsplice.select.method import TokenSelectionDecoder
    from kvsplice.select.selectors import UniformSelector
    api = "new"
else:  # three drivers
    from kvsplice.apply import CoefficientDecoder
    from kvsplice.calibrate import calibrate
    from kvsplice.fits import fit_bases
    from kvsplice.online import OnlineDecoder
    from kvsplice.token_driver import TokenSelectionDecoder
    from kvsplice.token_select import UniformSelector
    api = "old"
g = torch.Generator().manual_seed(0)
calib = torch.randint(3, 512, (4, 256), generator=g)
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 384
prompt = torch.randint(3, 512, (1, ctx), generator=g)
nxt = torch.randint(3, 512, (1, 1), generator=g)
decs = {"full": CoefficientDecoder(model)}
for rope in ("post", "pre"):
    st = calibrate(model, [calib], rope=rope, progress=False)
    decs[f"kq-r4-{rope}"] = CoefficientDecoder(model, fit_bases(st, "kq", rank=4))
    decs[f"kq-r4-{rope}-naive"] = CoefficientDecoder(model, fit_bases(st, "kq", rank=4), impl="naive")
decs["fd-online"] = OnlineDecoder(model, rank_k=4, rank_v=4, tau_k=None, max_chunk_len=64)
decs["select"] = TokenSelectionDecoder(model, UniformSelector(n_sink=4, n_recent=16), budget=128)
out = {}
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 30
with torch.no_grad():
    for name, dec in decs.items():
        cache = dec.new_cache(1)
        (dec.prefill if name == "select" else dec)(prompt, cache)
        held = cache.seq_len
        ts = []
        for i in range(reps + 3):
            t0 = time.thread_time()
            dec(nxt, cache)
            ts.append(time.thread_time() - t0)
            if name != "fd-online":
                cache.truncate(held)
        out[name] = statistics.median(ts[3:]) * 1e3
print(json.dumps({"api": api, **out}))
