"""llama.cpp as an optional engine: where it is and running a GGUF through its C API (logits, greedy tokens, the KV
cache's size); its converter and the one GGUF key our DeepSeek-V3 exports need are
:mod:`kvsplice.convert.engines.gguf_convert`.

llama.cpp is found at ``$KVSPLICE_LLAMA_CPP``, else ``build/engines/llama.cpp`` under the repository root (git
ignores it): a source tree with ``convert_hf_to_gguf.py``, ``gguf-py/`` and a cmake build in ``build/bin``
(``libllama.so``, ``llama-perplexity``, ...). docs/conversion.md says how to get and build it (the llama-cpp-python
0.3.36 source distribution vendors both the engine and its converter). The Python bindings used here are that
sdist's ``llama_cpp/llama_cpp.py`` (ctypes only, found at ``$KVSPLICE_LLAMA_CPP_PYTHON``, else beside the
llama.cpp folder as ``llama_cpp_python-*``), loaded without the package's high-level API and its dependencies.

"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
import types
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["ENV", "Q_LORA_KEY", "available_memory", "binary", "cache_bytes_per_cell", "llama_cpp_root", "load_failure",
           "max_sequences", "missing", "LlamaCppModel"]

ENV = "KVSPLICE_LLAMA_CPP"
ENV_PY = "KVSPLICE_LLAMA_CPP_PYTHON"
REPO = Path(__file__).resolve().parents[3]  # kvsplice/convert/engines/llama_cpp.py -> the repository
DEFAULT = REPO / "build" / "engines" / "llama.cpp"
Q_LORA_KEY = "deepseek2.attention.q_lora_rank"
"""The GGUF key llama.cpp's ``deepseek2`` loader needs and its converter leaves out
(:mod:`~kvsplice.convert.engines.gguf_convert`)."""


def llama_cpp_root() -> Path:
    """The llama.cpp source + build folder: ``$KVSPLICE_LLAMA_CPP`` or ``build/engines/llama.cpp``."""
    return Path(os.environ.get(ENV) or DEFAULT).expanduser()


def binary(name: str) -> Path:
    """A built llama.cpp program or library, e.g. ``binary("llama-perplexity")``."""
    return llama_cpp_root() / "build" / "bin" / name


def max_sequences() -> int:
    """The most sequences one llama.cpp context decodes at once: ``LLAMA_MAX_SEQ`` in its source
    (``src/llama-cparams.h``; 256 in the vendored 0.3.36 tree). A cache that holds more sequences than this serves them
    from several contexts (processes), not one batch."""
    header = llama_cpp_root() / "src" / "llama-cparams.h"
    found = re.search(r"#define\s+LLAMA_MAX_SEQ\s+(\d+)", header.read_text()) if header.is_file() else None
    if not found:
        raise FileNotFoundError(f"LLAMA_MAX_SEQ not found in {header} (is {ENV} a llama.cpp source tree?)")
    return int(found.group(1))


def _bindings_dir() -> Optional[Path]:
    env = os.environ.get(ENV_PY)
    if env:
        return Path(env).expanduser()
    found = sorted(d for d in llama_cpp_root().parent.glob("llama_cpp_python-*") if (d / "llama_cpp").is_dir())
    return found[-1] if found else None


def missing(*, converter: bool = True, library: bool = True, bindings: bool = False,
            programs: Sequence[str] = ()) -> Optional[str]:
    """``None`` when llama.cpp has what is asked for, else a one-line reason (tests skip with it)."""
    root = llama_cpp_root()
    if not root.is_dir():
        return f"llama.cpp not found at {root} (set {ENV}; docs/conversion.md builds it)"
    if converter and not (root / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp at {root} has no convert_hf_to_gguf.py"
    if library and not binary("libllama.so").is_file():
        return f"llama.cpp at {root} is not built ({binary('libllama.so')} missing)"
    for p in programs:
        if not binary(p).is_file():
            return f"llama.cpp at {root} has no {p} in build/bin"
    if bindings:
        d = _bindings_dir()
        if d is None or not (d / "llama_cpp" / "llama_cpp.py").is_file():
            return f"llama-cpp-python's source (llama_cpp/llama_cpp.py) not found beside {root} (set {ENV_PY})"
    return None


def load_failure(log: str, path: str | os.PathLike) -> str:
    """The cause of a failed load in llama.cpp's log, on one line (the log runs 8-9 lines with the cause last), and
    the fix to run when there is one: a ``deepseek2`` GGUF without ``q_lora_rank`` (converted by hand) needs
    ``kvsplice to-gguf --fix FILE``."""
    lines = [" ".join(ln.split()) for ln in log.splitlines() if ln.strip()]
    causes = [ln for ln in lines if "error loading model" in ln] or \
        [ln for ln in lines if re.search(r"error|failed|not found|invalid|unsupported", ln, re.I)]
    cause = (causes or lines or ["no log"])[-1]
    cause = re.sub(r"^\w+: (error loading model: )?", "", cause)[:240]
    if re.search(r"key not found[^\n]*" + re.escape(Q_LORA_KEY), log):
        return f"it lacks the key {Q_LORA_KEY} (a DeepSeek-V3 GGUF converted by hand): run kvsplice to-gguf --fix {path}"
    return cause


def cache_bytes_per_cell(n_layer: int, n_embd: int, tk, tv) -> int:
    """An upper bound of llama.cpp's K + V bytes per cache cell: every layer's keys and values ``n_embd`` wide (MHA;
    GQA and MLA cache less), in the cache types ``tk`` / ``tv`` (:class:`kv_types.KvType`)."""
    return n_layer * sum(-(-n_embd // t.block) * t.block_bytes for t in (tk, tv))


def available_memory() -> Optional[int]:
    """Bytes of memory available to a new allocation (``MemAvailable``, else the physical memory), ``None`` unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ------------------------------------------------------------------------------------------------ the C API
_LL = None
_LOG: list[str] = []


def _bindings():
    """llama-cpp-python's ctypes module (``llama_cpp.llama_cpp``) on the built ``libllama.so``, imported without
    the package ``__init__`` (which pulls in its high-level API and its dependencies)."""
    global _LL
    if _LL is not None:
        return _LL
    why = missing(converter=False, bindings=True)
    if why:
        raise RuntimeError(why)
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(binary("libllama.so").parent))
    pkg_dir = _bindings_dir() / "llama_cpp"
    if "llama_cpp" not in sys.modules:
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [str(pkg_dir)]  # a namespace for its submodules only
        sys.modules["llama_cpp"] = pkg
    spec = importlib.util.spec_from_file_location("llama_cpp.llama_cpp", pkg_dir / "llama_cpp.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["llama_cpp.llama_cpp"] = mod
    spec.loader.exec_module(mod)

    @mod.llama_log_callback
    def _log(level, text, user_data):  # keep llama.cpp's log (the KV cache size is read from it)
        _LOG.append(text.decode("utf-8", "replace"))

    mod._kvsplice_log = _log  # keep the callback alive
    mod.llama_log_set(_log, ctypes.c_void_p(0))
    mod.llama_backend_init()
    _LL = mod
    return mod


class LlamaCppModel:
    """A GGUF in llama.cpp: ``logits(ids)`` (every position), ``continuation_nll(ids, prompt_len)`` (protocol P's
    scoring), ``greedy(ids, n)``, ``tokenize(text)`` and ``kv_bytes_per_token`` (the K + V cache llama.cpp
    allocated, from its log line, over its cells).

    ``n_ctx`` cells; one sequence, one thread by default; batches of up to ``n_batch`` tokens (default ``n_ctx``: a
    prompt is one batch, as in our prefill). The cache holds K in ``type_k`` and V in ``type_v`` (each
    defaults to ``cache_type``): any name of :data:`kvsplice.convert.engines.kv_types.KV_TYPES` (``"f16"``, ``"q8_0"``,
    ``"q4_0"``, ``"q4_1"``, ``"iq4_nl"``, ...); an unknown name is a one-line ``ValueError``. ``flash_attn``:
    ``True`` / ``False`` / ``None`` (llama.cpp's auto). llama.cpp quantises V only under flash attention, so a
    quantised ``type_v`` turns it on when it is left to ``None`` and refuses ``flash_attn=False`` (one line).
    ``repack=False`` (the default; llama.cpp's ``--no-repack``): with weight repacking, an f16 ``deepseek2`` GGUF of
    SmolLM2's shapes aborts in llama.cpp 0.3.36's scheduler (``GGML_ASSERT(*cur_backend_id != -1)``, also with a real
    latent norm: llama.cpp's, not the export's); f32 / bf16 GGUFs run either way."""

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 512, cache_type: str = "f16",
                 type_k: Optional[str] = None, type_v: Optional[str] = None, flash_attn: Optional[bool] = None,
                 threads: int = 1, repack: bool = False, n_batch: Optional[int] = None):
        from kvsplice.convert.engines.kv_types import kv_type

        tk, tv = kv_type(type_k or cache_type), kv_type(type_v or cache_type)  # unknown names fail here, in one line
        if tv.block > 1 and flash_attn is False:
            raise ValueError(f"llama.cpp quantises V ({tv.name}) only with flash attention: flash_attn=False refused")
        if tv.block > 1 and flash_attn is None:
            flash_attn = True  # llama.cpp's auto may pick no flash attention, and then refuses a quantised V
        for name, v in (("n_ctx", n_ctx), ("n_batch", n_batch), ("threads", threads)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        ll = _bindings()
        self.ll = ll
        self.type_k, self.type_v = tk.name, tv.name
        mp = ll.llama_model_default_params()
        mp.use_extra_bufts = bool(repack)
        _LOG.clear()
        self.model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}: {load_failure(''.join(_LOG), path)}")
        need = n_ctx * cache_bytes_per_cell(int(ll.llama_model_n_layer(self.model)),
                                            int(ll.llama_model_n_embd(self.model)), tk, tv)
        free = available_memory()
        if free is not None and need > free:  # the cache is allocated up front: 10**9 cells took the machine's memory
            trained = int(ll.llama_model_n_ctx_train(self.model))
            self.close()
            raise ValueError(f"n_ctx {n_ctx} needs a KV cache of up to {need / 2 ** 30:,.1f} GiB, more than the "
                             f"{free / 2 ** 30:,.1f} GiB of memory available; {Path(path).name} was trained for "
                             f"{trained} positions: give a smaller n_ctx")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        cp = ll.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = n_batch or n_ctx
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k, cp.type_v = tk.ggml_id, tv.ggml_id
        fa = {None: ll.LLAMA_FLASH_ATTN_TYPE_AUTO, True: ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              False: ll.LLAMA_FLASH_ATTN_TYPE_DISABLED}
        cp.flash_attn_type = fa[flash_attn]
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self.close()
            raise RuntimeError(f"llama.cpp could not make a context for {path}: {load_failure(''.join(_LOG), path)}")
        self.n_ctx = ll.llama_n_ctx(self.ctx)
        self.n_batch = ll.llama_n_batch(self.ctx)
        self.log = "".join(_LOG)

    # ---------------------------------------------------------------------------------------- cache size
    def kv_cache(self) -> dict[str, Any]:
        """llama.cpp's own report: ``cells``, ``layers``, ``k_type``, ``k_mib``, ``v_type``, ``v_mib``."""
        m = re.search(r"size\s*=\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*?K \((\w+)\):\s*([\d.]+) MiB, "
                      r"V \((\w+)\):\s*([\d.]+) MiB", self.log)
        if m is None:
            raise RuntimeError("llama.cpp's log has no KV cache size line")
        return {"cells": int(m[2]), "layers": int(m[3]), "k_type": m[4], "k_mib": float(m[5]), "v_type": m[6],
                "v_mib": float(m[7])}

    @property
    def kv_bytes_per_token(self) -> float:
        """K + V bytes per cached token (all layers), as llama.cpp reports them (MiB to 2 decimals: exact to
        ``0.005 MiB / cells`` bytes — use many cells)."""
        kv = self.kv_cache()
        return (kv["k_mib"] + kv["v_mib"]) * 2 ** 20 / kv["cells"]

    # ---------------------------------------------------------------------------------------- running
    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        ll, raw = self.ll, text.encode("utf-8")
        buf = (ll.llama_token * (len(raw) + 8))()
        n = ll.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), add_special, False)
        if n < 0:
            raise RuntimeError("llama_tokenize: buffer too small")
        return list(buf[:n])

    def reset(self) -> None:
        ll = self.ll
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)

    def _decode(self, ids: Sequence[int], pos0: int, all_logits: bool):
        """``ids`` at positions ``pos0 ...`` into the cache, in pieces of ``n_batch``; logits of every position
        (``all_logits``: one piece only) or of the last."""
        if len(ids) > self.n_batch:
            if all_logits:
                raise ValueError(f"{len(ids)} tokens with every logit exceed n_batch = {self.n_batch}")
            for s0 in range(0, len(ids), self.n_batch):
                self._decode(ids[s0:s0 + self.n_batch], pos0 + s0, False)
            return
        ll = self.ll
        n = len(ids)
        batch = ll.llama_batch_init(n, 0, 1)
        try:
            for j, t in enumerate(ids):
                batch.token[j] = int(t)
                batch.pos[j] = pos0 + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = bool(all_logits or j == n - 1)
            batch.n_tokens = n
            rc = ll.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            ll.llama_batch_free(batch)

    def logits(self, ids: Sequence[int]):
        """``(T, V)`` float32 numpy logits of every position of ``ids`` (one fresh sequence)."""
        import numpy as np

        self.reset()
        self._decode(ids, 0, True)
        return np.stack([self._logits_at(j) for j in range(len(ids))]).astype(np.float32, copy=False)

    def continuation_nll(self, ids: Sequence[int], prompt_len: int, chunk: int = 64) -> tuple[float, int]:
        """Protocol P's scoring in llama.cpp (as :func:`kvsplice.decode.score_continuation`): ``ids[:prompt_len]``
        prefilled into a fresh cache (one batch when it fits ``n_batch``), ``ids[prompt_len:-1]`` decoded teacher-forced in chunks of
        ``chunk`` over it, ``ids[prompt_len:]`` scored (the prefill's last position predicts the first). Returns
        ``(summed NLL, tokens scored)``; the log-softmax in float64."""
        import numpy as np

        t, p = len(ids), int(prompt_len)
        if not 1 <= p < t <= self.n_ctx:
            raise ValueError(f"prompt_len must be in [1, {t - 1}] and the window within n_ctx = {self.n_ctx}")
        self.reset()
        self._decode(ids[:p], 0, False)
        rows = [self._logits_at(-1)]
        for s0 in range(p, t - 1, chunk):
            part = ids[s0:min(t - 1, s0 + chunk)]
            self._decode(part, s0, True)
            rows += [self._logits_at(j) for j in range(len(part))]
        lg = np.stack(rows).astype(np.float64)  # (t - p, V)
        m = lg.max(axis=1, keepdims=True)
        logz = (m[:, 0] + np.log(np.exp(lg - m).sum(axis=1)))
        target = np.asarray(ids[p:], dtype=np.int64)
        return float((logz - lg[np.arange(len(target)), target]).sum()), len(target)

    def _logits_at(self, j: int):
        """A copy of the logits of output ``j`` of the last decode (``-1``: its last)."""
        import numpy as np

        return np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, j), shape=(self.n_vocab,)).copy()

    def greedy(self, ids: Sequence[int], n: int, *, then: Sequence[int] = (), eos: Optional[int] = None) -> list[int]:
        """Up to ``n`` greedy tokens: ``ids`` prefilled in one batch, then ``then`` (if any: a question fed over the
        cache as one more batch), then one token per step; stops after ``eos`` (kept)."""
        self.reset()
        self._decode(ids, 0, False)
        pos = len(ids)
        if len(then):
            self._decode(then, pos, False)
            pos += len(then)
        out: list[int] = []
        for i in range(n):
            t = int(self._logits_at(-1).argmax())
            out.append(t)
            if t == eos or i == n - 1:
                break
            self._decode([t], pos, False)
            pos += 1
        return out

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.ll.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "LlamaCppModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
