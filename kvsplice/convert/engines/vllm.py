"""vLLM as an optional engine: run a DeepSeek-V3 export (greedy tokens, per-token log-probabilities, perplexity) and
read which attention backend vLLM picked and how large a KV cache row it allocated.

vLLM lives in its own virtual environment (it pins its own transformers and needs torchvision & co. removed:
docs/conversion.md, "vLLM"); its interpreter is ``$KVSPLICE_VLLM_PYTHON``, else ``build/vllm-venv/bin/python``
under the repository root (git ignores ``build/``). Each call runs :mod:`kvsplice.convert.engines.vllm_worker` in that
interpreter as a subprocess (one JSON request in, one JSON answer out), so nothing of vLLM is imported here.

vLLM's MLA backends take ``kv_lora_rank + qk_rope_head_dim`` of 320, 512 or 576 only, its CPU decode kernel exactly
512 + 64. Two routes: the unpadded export through the package's vLLM plugin
(:mod:`kvsplice.convert.engines.vllm_plugin`, ``plugin=True``, the default: the true latent cache), or an export padded
to 512 + 64 (``training.export --pad-latent 512 --pad-rope 64``, exact: :mod:`kvsplice.convert.latent_pad`) on vLLM's
own kernel. Where the package is not installed in vLLM's environment, each run makes the plugin visible to it for
that run only (``PYTHONPATH`` to a folder holding the ``kvsplice`` package and its ``vllm.general_plugins`` entry
point), so vLLM loads it the way it loads an installed one.
The worker runs vLLM's RoPE as PyTorch code by default: its CPU C++ RoPE op mis-indexes MLA's strided query / key
slices (the worker's docstring; ``native_rope=False`` shows it).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["ENV", "PLUGIN_ENTRY", "VllmError", "VllmRun", "missing", "plugin_path", "run", "vllm_python"]

ENV = "KVSPLICE_VLLM_PYTHON"
REPO = Path(__file__).resolve().parents[3]  # the repository root (kvsplice/convert/engines/vllm.py)
DEFAULT = REPO / "build" / "vllm-venv" / "bin" / "python"
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
PLUGIN_ENTRY = "kvsplice_latent_mla = kvsplice.convert.engines.vllm_plugin:register"
"""The ``vllm.general_plugins`` entry point (pyproject.toml declares the same one)."""


class VllmError(RuntimeError):
    """vLLM refused or failed to run the model (one line: its last error line)."""


def vllm_python() -> Path:
    """The interpreter of vLLM's virtual environment: ``$KVSPLICE_VLLM_PYTHON`` or ``build/vllm-venv/bin/python``."""
    return Path(os.environ.get(ENV) or DEFAULT).expanduser()


def missing() -> Optional[str]:
    """``None`` when vLLM's interpreter exists and has ``vllm``, else a one-line reason (tests skip with it)."""
    py = vllm_python()
    if not py.is_file():
        return f"vLLM's python not found at {py} (set {ENV}; docs/conversion.md installs it)"
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    probe = subprocess.run([str(py), "-c", code], capture_output=True, timeout=120)
    if probe.returncode != 0:
        return f"{py} has no vllm package (docs/conversion.md installs it)"
    return None


@dataclass
class VllmRun:
    """What one run of the worker returned."""

    greedy: list[int] = field(default_factory=list)
    """Greedy continuation of the prompt (``new`` tokens, end-of-text ignored)."""
    logprobs: list[Optional[float]] = field(default_factory=list)
    """``log p(ids[i] | ids[:i])`` per scored token; ``None`` for the first."""
    layers: list[dict[str, Any]] = field(default_factory=list)
    """Per attention layer: backend, decode kernel (``vllm`` / ``torch``: the plugin's), prefill backend, KV cache
    tensor shape / dtype / element size."""
    cache_tokens: int = 0
    """vLLM's own count of KV cache tokens (its blocks × block size) for ``kv_cache_bytes``."""
    kv_cache_bytes: int = 0
    throughput: Optional[dict[str, Any]] = None
    """With ``throughput=``: seqs, prompt, new, prefill / decode seconds, decode tokens, ``decode_tok_s``."""
    version: str = ""
    native_rope: bool = True

    @property
    def perplexity(self) -> float:
        """``exp`` of the mean negative log-probability of every scored token after the first."""
        lp = [v for v in self.logprobs[1:] if v is not None]
        if not lp:
            raise ValueError("no scored tokens: pass score=ids with at least two tokens")
        return math.exp(-sum(lp) / len(lp))

    @property
    def backend(self) -> str:
        """The attention backend vLLM picked (the first layer's, e.g. ``CPU_MLA``)."""
        return self.layers[0]["backend"] if self.layers else ""

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache per token over all layers, from the cache tensors vLLM allocated: an MLA layer's
        ``(blocks, block_size, row)`` tensor holds one ``row`` of ``element_size`` bytes per token; any other layer's
        tensor bytes over its blocks × block size (``cache_tokens``)."""
        total = 0
        for la in self.layers:
            if "kv_cache_bytes" in la and la["backend"] not in ("CPU_MLA", "AMX_MLA", "TRITON_MLA"):
                total += int(la["kv_cache_bytes"]) // max(self.cache_tokens, 1)
            else:
                total += int(la["kv_cache_shape"][-1]) * int(la["element_size"])
        return total

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the allocated cache holds (blocks × block size of the first layer)."""
        shape = self.layers[0]["kv_cache_shape"] if self.layers else [0, 0]
        return int(shape[0]) * int(shape[1])


def run(model_dir: str | Path, *, prompt: Optional[Sequence[int]] = None, new: int = 0,
        score: Optional[Sequence[int]] = None, dtype: str = "float32", max_model_len: int = 128,
        native_rope: bool = True, kv_cache_gib: int = 1, kv_cache_bytes: Optional[int] = None,
        others: Sequence[Sequence[int]] = (), throughput: Optional[dict[str, int]] = None,
        max_num_seqs: Optional[int] = None, block_size: Optional[int] = None, plugin: bool = True,
        timeout: float = 900.0) -> VllmRun:
    """Run ``model_dir`` in vLLM (offline ``LLM``, eager, ``dtype``): greedy ``new`` tokens after ``prompt`` and/or
    the log-probability of every token of ``score``, each in one batch with the prompts ``others``; with
    ``throughput={"seqs", "prompt", "new"}`` the decode tokens/s of that many random prompts. The KV cache gets
    ``kv_cache_bytes`` (default ``kv_cache_gib`` GiB) in blocks of ``block_size`` tokens (non-MLA models; vLLM's CPU
platform sets 16 for MLA). ``plugin``: load the package's vLLM plugin (any latent row).
    Raises :class:`VllmError` (one line) when vLLM is absent or refuses the model, ``ValueError`` for bad
    arguments."""
    if prompt is None and score is None and throughput is None:
        raise ValueError("nothing to run: give prompt (with new > 0), score and/or throughput")
    if prompt is not None and (not prompt or new <= 0):
        raise ValueError("prompt needs at least one token and new > 0")
    why = missing()
    if why:
        raise VllmError(why)
    req = {"model": str(Path(model_dir).resolve()), "dtype": dtype, "max_model_len": int(max_model_len),
           "native_rope": bool(native_rope), "kv_cache_gib": int(kv_cache_gib),
           "kv_cache_bytes": None if kv_cache_bytes is None else int(kv_cache_bytes), "any_row": bool(plugin),
           "generate": None if prompt is None else [[int(t) for t in prompt], int(new)],
           "score": None if score is None else [int(t) for t in score],
           "others": [[int(t) for t in p] for p in others], "throughput": throughput, "max_num_seqs": max_num_seqs,
           "block_size": block_size}
    with tempfile.TemporaryDirectory(prefix="kvsplice_vllm_") as tmp:
        req_path, out_path = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        req_path.write_text(json.dumps(req), encoding="utf-8")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)  # the venv's own packages only (never this checkout's transformers & co.)
        if plugin:
            env["PYTHONPATH"] = str(plugin_path(Path(tmp) / "plugin"))
        proc = subprocess.run([str(vllm_python()), str(WORKER), str(req_path), str(out_path)], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=tmp)
        if proc.returncode != 0 or not out_path.is_file():
            raise VllmError(f"vLLM failed on {model_dir}: {_last_error(proc.stderr + proc.stdout)}")
        ans = json.loads(out_path.read_text(encoding="utf-8"))
    return VllmRun(greedy=ans.get("greedy") or [], logprobs=ans.get("logprobs") or [], layers=ans["layers"],
                   version=ans["vllm"], native_rope=ans["native_rope"], cache_tokens=ans.get("cache_tokens", 0),
                   kv_cache_bytes=ans.get("kv_cache_bytes", 0), throughput=ans.get("throughput"))


def plugin_path(folder: Path) -> Path:
    """Make ``folder`` a path entry that holds this checkout's ``kvsplice`` package (a link) and the plugin's
    ``vllm.general_plugins`` entry point (a minimal ``.dist-info``), so that vLLM's interpreter finds the plugin
    without installing the package there."""
    info = folder / "kvsplice_vllm_plugin-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvsplice-vllm-plugin\nVersion: 0.0\n",
                                   encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_ENTRY}\n", encoding="utf-8")
    link = folder / "kvsplice"
    if not link.exists():
        link.symlink_to(REPO / "kvsplice", target_is_directory=True)
    return folder


def _last_error(log: str) -> str:
    """The most telling line of a failed run: its last ``...Error: ...`` line that is not a logged warning (vLLM logs
    a harmless tokenizer ``ValueError`` when started on token ids), else its last line."""
    lines = [ln.strip().removeprefix("[rank0]:").strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ("Error:" in ln or "Error(" in ln) and " WARNING " not in ln]
    return (errors or lines or ["no output"])[-1][:500]
