"""vLLM as an optional engine: run a DeepSeek-V3 export (greedy tokens, per-token log-probabilities, perplexity) and
read which attention backend vLLM picked and how large a KV cache row it allocated.

vLLM lives in its own virtual environment (it pins its own transformers and needs torchvision & co. removed:
docs/conversion.md, "vLLM"); its interpreter is ``$KVSPLICE_VLLM_PYTHON``, else ``build/vllm-venv/bin/python``
under the repository root (git ignores ``build/``). Each call runs :mod:`kvsplice.convert.engines.vllm_worker` in that
interpreter as a subprocess (one JSON request in, one JSON answer out), so nothing of vLLM is imported here.

vLLM's MLA backends take ``kv_lora_rank + qk_rope_head_dim`` of 320, 512 or 576 only, its CPU decode kernel exactly
512 + 64: export with ``training.export --pad-latent 512 --pad-rope 64`` (exact, :mod:`kvsplice.convert.latent_pad`).
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

__all__ = ["ENV", "VllmError", "VllmRun", "missing", "run", "vllm_python"]

ENV = "KVSPLICE_VLLM_PYTHON"
REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "build" / "vllm-venv" / "bin" / "python"
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")


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
    """Per attention layer: backend, prefill backend, KV cache tensor shape / dtype / element size."""
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
        """Bytes of KV cache per token over all layers, from the cache tensors vLLM allocated: each layer's
        ``(blocks, block_size, row)`` tensor holds one ``row`` of ``element_size`` bytes per token."""
        return sum(int(la["kv_cache_shape"][-1]) * int(la["element_size"]) for la in self.layers)

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the allocated cache holds (blocks × block size of the first layer)."""
        shape = self.layers[0]["kv_cache_shape"] if self.layers else [0, 0]
        return int(shape[0]) * int(shape[1])


def run(model_dir: str | Path, *, prompt: Optional[Sequence[int]] = None, new: int = 0,
        score: Optional[Sequence[int]] = None, dtype: str = "float32", max_model_len: int = 128,
        native_rope: bool = True, kv_cache_gib: int = 1, timeout: float = 900.0) -> VllmRun:
    """Run ``model_dir`` in vLLM (offline ``LLM``, eager, ``dtype``): greedy ``new`` tokens after ``prompt`` and/or
    the log-probability of every token of ``score``. Raises :class:`VllmError` (one line) when vLLM is absent or
    refuses the model, ``ValueError`` for bad arguments."""
    if prompt is None and score is None:
        raise ValueError("nothing to run: give prompt (with new > 0) and/or score")
    if prompt is not None and (not prompt or new <= 0):
        raise ValueError("prompt needs at least one token and new > 0")
    why = missing()
    if why:
        raise VllmError(why)
    req = {"model": str(Path(model_dir).resolve()), "dtype": dtype, "max_model_len": int(max_model_len),
           "native_rope": bool(native_rope), "kv_cache_gib": int(kv_cache_gib),
           "generate": None if prompt is None else [[int(t) for t in prompt], int(new)],
           "score": None if score is None else [int(t) for t in score]}
    with tempfile.TemporaryDirectory(prefix="kvsplice_vllm_") as tmp:
        req_path, out_path = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        req_path.write_text(json.dumps(req), encoding="utf-8")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)  # the venv's own packages only (never this checkout's transformers & co.)
        proc = subprocess.run([str(vllm_python()), str(WORKER), str(req_path), str(out_path)], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=tmp)
        if proc.returncode != 0 or not out_path.is_file():
            raise VllmError(f"vLLM failed on {model_dir}: {_last_error(proc.stderr + proc.stdout)}")
        ans = json.loads(out_path.read_text(encoding="utf-8"))
    return VllmRun(greedy=ans.get("greedy") or [], logprobs=ans.get("logprobs") or [], layers=ans["layers"],
                   version=ans["vllm"], native_rope=ans["native_rope"])


def _last_error(log: str) -> str:
    """The most telling line of a failed run: its last ``...Error: ...`` line that is not a logged warning (vLLM logs
    a harmless tokenizer ``ValueError`` when started on token ids), else its last line."""
    lines = [ln.strip().removeprefix("[rank0]:").strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ("Error:" in ln or "Error(" in ln) and " WARNING " not in ln]
    return (errors or lines or ["no output"])[-1][:500]
