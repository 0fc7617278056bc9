"""One typed config for every GPT-2 variant (MHA, MLA, MLA + KVSplice), plus named presets.

Training configs (``configs/NAME.yaml``) are found relative to the package, not the current directory
(:data:`CONFIG_DIR`, :func:`config_path`); :meth:`GPTConfig.from_name` / :meth:`GPTConfig.from_file` read their
``model:`` section.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

from models.kernels import DECODE_KERNELS, DEFAULT_DECODE_KERNEL

Attention = Literal["mha", "mla"]
AttnBackend = Literal["auto", "flash", "sdpa"]
MLAImpl = Literal["absorb", "naive"]
DecodeKernel = Literal["auto", "triton", "eager"]

ATTENTIONS = ("mha", "mla")
ATTN_BACKENDS = ("auto", "flash", "sdpa")
MLA_IMPLS = ("absorb", "naive")
CACHE_QUANTS = (None, "int8")

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The project's training configs (``configs/`` next to the ``models`` package, whatever the current directory)."""


class ConfigNotFoundError(ValueError):
    """A config name or path that names no file; the one-line message lists the available names."""


def available_configs(config_dir: Path = CONFIG_DIR) -> list[str]:
    """Names (file stems) of the ``*.yaml`` configs in ``config_dir``, sorted."""
    return sorted(p.stem for p in config_dir.glob("*.yaml")) if config_dir.is_dir() else []


def config_path(name: Union[str, "os.PathLike[str]"], config_dir: Path = CONFIG_DIR) -> Path:
    """The config file for ``name``: an existing file path as given, else ``config_dir/NAME`` or
    ``config_dir/NAME.yaml`` (``config_dir`` defaults to the package's ``configs/``, so any working directory works).

    Raises:
        ConfigNotFoundError: nothing matches; the message lists the available names.
    """
    value = str(name)
    p = Path(value).expanduser()
    if p.is_file():
        return p
    if not p.is_absolute():
        for cand in (config_dir / value, config_dir / f"{value}.yaml"):
            if cand.is_file():
                return cand
    available = ", ".join(available_configs(config_dir)) or "none"
    raise ConfigNotFoundError(f"config {value!r}: no such file and no {config_dir}/{p.stem}.yaml "
                              f"(available: {available})")


@dataclass
class GPTConfig:
    """Shapes and options of a GPT-2-style decoder.

    ``attention="mha"`` is standard GPT-2. ``attention="mla"`` caches one shared latent of ``d_latent`` numbers per
    token per layer and up-projects K and V from it. With ``kvsplice_ratio`` set, a learned compress/expand pair
    shrinks that latent to ``d_compressed = round(d_latent * kvsplice_ratio)`` numbers (0.5/0.3/0.1 of 256 →
    128/77/26), and only the compressed latent is cached.
    """

    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True
    attention: Attention = "mha"
    d_latent: int = 256
    kvsplice_ratio: Optional[float] = None
    kvsplice_orthogonal: bool = False
    attn_backend: AttnBackend = "auto"
    mla_impl: MLAImpl = "absorb"
    """How MLA attends over cached latents: ``absorb`` folds w_uk / w_uv (and expand) into the query and output and
    attends in latent space; ``naive`` re-expands every cached latent into full K/V first (reference path)."""
    decode_kernel: DecodeKernel = DEFAULT_DECODE_KERNEL  # type: ignore[assignment]
    """One-token cached steps: ``auto`` runs the split-KV Triton kernel (:mod:`models.kernels`) on CUDA when triton
    is installed and the eager SDPA path elsewhere; ``triton`` forces the kernel (on CPU only under Triton's
    interpreter); ``eager`` never. Decode only: the full forward (training) is unchanged."""
    n_kv_head: Optional[int] = None
    """MHA only: key/value heads for grouped-query attention (``n_head`` / ``None``: standard MHA; 1: multi-query).
    Query head ``h`` reads KV head ``h // (n_head // n_kv_head)``; the cache holds ``2·n_kv_head·head_size`` numbers
    per token per layer."""
    latent_norm: bool = False
    """MLA only: RMSNorm on the latent ``c = w_dkv x`` before it is cached (and before KVSplice's compress), as
    DeepSeek-V2's ``kv_a_layernorm``. Per token, so absorbed decode stays exact."""
    kvsplice_norm: bool = False
    """MLA + KVSplice only: RMSNorm on the compressed latent ``s = C c`` (after the compress, before caching): the
    cached vector is normalised as an MLA latent of that size would be. Per token, so absorbed decode stays exact."""
    cache_quant: Optional[str] = None
    """``None``: the decode cache holds the model's dtype; ``"int8"``: every cached row (K/V per head, or the
    latent) is stored as int8 with one fp16 absmax scale, dequantised inside the attention call. Decode only: the
    full forward (training) is unchanged."""

    def __post_init__(self) -> None:
        def need(cond: bool, field: str, allowed: str, value) -> None:
            if not cond:
                raise ValueError(f"GPTConfig.{field} must be {allowed}, got {value!r}")

        for f in ("vocab_size", "n_layer", "n_head", "d_model", "block_size", "d_latent"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f, "an integer >= 1", v)
        need(self.d_model % self.n_head == 0, "d_model", f"divisible by n_head={self.n_head}", self.d_model)
        need(isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0, "dropout", "in [0, 1)",
             self.dropout)
        need(self.attention in ATTENTIONS, "attention", f"one of {ATTENTIONS}", self.attention)
        need(self.attn_backend in ATTN_BACKENDS, "attn_backend", f"one of {ATTN_BACKENDS}", self.attn_backend)
        need(self.decode_kernel in DECODE_KERNELS, "decode_kernel", f"one of {DECODE_KERNELS}", self.decode_kernel)
        need(self.mla_impl in MLA_IMPLS, "mla_impl", f"one of {MLA_IMPLS}", self.mla_impl)
        need(self.cache_quant in CACHE_QUANTS, "cache_quant", f"one of {CACHE_QUANTS}", self.cache_quant)
        if self.n_kv_head is not None:
            kv = self.n_kv_head
            need(isinstance(kv, int) and not isinstance(kv, bool) and kv >= 1 and self.n_head % kv == 0,
                 "n_kv_head", f"None or an integer >= 1 dividing n_head={self.n_head}", kv)
            need(self.attention == "mha", "n_kv_head", "None unless attention='mha' (MLA shares one latent across "
                 "heads already)", kv)
        need(isinstance(self.latent_norm, bool), "latent_norm", "true or false", self.latent_norm)
        need(not self.latent_norm or self.attention == "mla", "latent_norm", "false unless attention='mla'",
             self.latent_norm)
        need(isinstance(self.kvsplice_norm, bool), "kvsplice_norm", "true or false", self.kvsplice_norm)
        need(not self.kvsplice_norm or self.kvsplice_ratio is not None, "kvsplice_norm",
             "false unless kvsplice_ratio is set", self.kvsplice_norm)
        if self.kvsplice_ratio is not None:
            r = self.kvsplice_ratio
            need(isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 < r < 1.0, "kvsplice_ratio",
                 "None or a number with 0 < ratio < 1", r)
            need(self.attention == "mla", "kvsplice_ratio", "None unless attention='mla' (KVSplice compresses the "
                 "MLA latent)", r)
            need(round(self.d_latent * r) >= 1, "kvsplice_ratio", f"large enough that round(d_latent * ratio) >= 1 "
                 f"(d_latent={self.d_latent})", r)
        if self.attention == "mla":  # last: the checks above name the field the user actually got wrong
            need(self.d_latent <= self.d_model, "d_latent", f"<= d_model={self.d_model} for attention='mla' (the "
                 f"latent compresses K/V; a larger one would cache more than it saves)", self.d_latent)

    # ------------------------------------------------------------------------------------------------ derived
    @property
    def head_size(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the MHA model: ``n_kv_head`` or ``n_head``."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def d_compressed(self) -> Optional[int]:
        return None if self.kvsplice_ratio is None else int(round(self.d_latent * self.kvsplice_ratio))

    @property
    def variant(self) -> str:
        """Short name: ``mha``, ``gqa<n_kv_head>``, ``mqa``, ``mla`` or ``mla_kvsplice_<compression %>``."""
        if self.attention == "mha":
            kv = self.kv_heads
            return "mha" if kv == self.n_head else "mqa" if kv == 1 else f"gqa{kv}"
        if self.kvsplice_ratio is None:
            return "mla"
        return f"mla_kvsplice_{round(100 * (1 - self.kvsplice_ratio))}"

    @property
    def cache_dim(self) -> int:
        """Elements cached per token per layer: ``2·kv_heads·head_size`` (MHA/GQA/MQA; ``2·d_model`` for MHA),
        ``d_latent`` (MLA), ``d_compressed`` (KVSplice)."""
        if self.attention == "mha":
            return 2 * self.kv_heads * self.head_size
        return self.d_compressed if self.d_compressed is not None else self.d_latent

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"GPTConfig got unknown fields {unknown}; known fields: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_file(cls, path: Union[str, "os.PathLike[str]"], **overrides: Any) -> "GPTConfig":
        """The ``model:`` section of a training YAML (``configs/*.yaml`` or a run's ``config.yaml``) as a config.

        Keys that are not GPTConfig fields (``learning_rate``, ``warmup_steps``, ``vocab_multiple``...) are ignored;
        a LightningCLI ``model: {class_path: ..., init_args: {...}}`` section is read from its ``init_args``.
        ``vocab_size`` is usually not in a training YAML (the CLI links it from the tokenizer): it then keeps the
        default unless given in ``overrides``, which replace any field.

        Raises:
            ValueError: the file is missing, is not YAML, has no ``model:`` mapping, or the values are invalid
                (the message names the file and the field).
        """
        import yaml

        p = Path(path).expanduser()
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"{p}: cannot read config ({e.strerror or type(e).__name__})") from None
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"{p}: not a valid YAML file ({str(e).splitlines()[0]})") from None
        model = data.get("model") if isinstance(data, dict) else None
        if isinstance(model, dict) and isinstance(model.get("init_args"), dict):
            model = model["init_args"]
        if not isinstance(model, dict):
            raise ValueError(f"{p}: no 'model:' section with GPTConfig fields")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in model.items() if k in names}
        fields.update(overrides)
        try:
            return cls.from_dict(fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}: {e}") from None

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "GPTConfig":
        """:meth:`from_file` of ``configs/NAME.yaml`` in the package's config folder (:data:`CONFIG_DIR`, found from
        the package location, not the current directory); a path to a YAML file works too.

        Raises:
            ConfigNotFoundError: no such config (the message lists the available names).
            ValueError: the file's ``model:`` section is invalid.
        """
        return cls.from_file(config_path(name), **overrides)


PRESETS = ("gpt2", "gpt2_gqa4", "gpt2_mqa", "mla", "mla_kvsplice_50", "mla_kvsplice_70", "mla_kvsplice_90")
"""The GPT-2 124M configs (12 layers, 12 heads, d_model 768, block 1024, d_latent 256): MHA, GQA with 4 KV heads and
MQA (the baselines with a smaller standard cache), MLA and MLA + KVSplice 50/70/90. A preset *is* its training YAML
(``configs/NAME.yaml``): the tools (``verify_memory``, ``bench_decode``) measure exactly the model
``python -m training.fit --config NAME`` trains."""


def preset(name: str, **overrides) -> GPTConfig:
    """The ``model:`` section of ``configs/NAME.yaml`` for a 124M preset (:data:`PRESETS`), with optional field
    overrides; ``vocab_size`` is the padded GPT-2 vocabulary (50304) the training run links from its tokenizer."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig.from_name(name, **overrides)
