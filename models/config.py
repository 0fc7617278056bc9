"""One typed config for every GPT-2 variant (MHA, MLA, MLA + KVSplice), plus named presets.

Training configs (``configs/NAME.yaml``) are found relative to the package, not the current directory
(:data:`CONFIG_DIR`, :func:`config_path`); :meth:`GPTConfig.from_name` / :meth:`GPTConfig.from_file` read their
``model:`` section.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from models.compat import OLD_NAMES, old_name_note, rename_old_keys
from models.kernels import DECODE_KERNELS, DEFAULT_DECODE_KERNEL

Attention = Literal["mha", "mla"]
Layout = Literal["gpt2", "deepseek_v3"]
AttnBackend = Literal["auto", "flash", "sdpa"]
MLAImpl = Literal["absorb", "naive"]
DecodeKernel = Literal["auto", "triton", "eager"]

ATTENTIONS = ("mha", "mla")
LAYOUTS = ("gpt2", "deepseek_v3")
GPT2, DEEPSEEK_V3 = LAYOUTS
RMS_NORM_EPS = 1e-6
"""eps of every RMSNorm of the ``deepseek_v3`` layout (blocks, final norm, the latent's ``kv_a_layernorm``): one
value, because transformers' DeepSeek-V3 fixes ``kv_a_layernorm`` at 1e-6 while llama.cpp normalises the latent
with ``rms_norm_eps`` — only ``rms_norm_eps = 1e-6`` makes both compute our model."""
ATTN_BACKENDS = ("auto", "flash", "sdpa")
MLA_IMPLS = ("absorb", "naive")
CACHE_QUANTS = (None, "int8")

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The project's training configs (``configs/`` next to the ``models`` package, whatever the current directory)."""


RUNTIME = {"runtime": True}
"""Metadata of the :class:`GPTConfig` fields that choose how the model runs, not what it is (dropout, kernels, the
decode path): a resumed or fine-tuned run may change them; every other field is its architecture
(:meth:`GPTConfig.architecture`)."""


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
    """Shapes and options of a GPT-2-style decoder, in the GPT-2 or the DeepSeek-V3 block layout (``layout``).

    ``attention="mha"`` is standard GPT-2. ``attention="mla"`` caches one shared latent of ``d_latent`` numbers per
    token per layer and up-projects K and V from it. With ``kvsplice_keep`` set (the fraction of the latent kept), a
    learned compress/expand pair shrinks that latent to ``d_compressed = round(d_latent * kvsplice_keep)`` numbers
    (0.5/0.3/0.1 of 256 → 128/77/26: KVSplice-50/70/90), and only the compressed latent is cached.

    Files may hold a field under an old name (:mod:`models.compat`; read by :meth:`from_dict` / :meth:`from_file`).
    :meth:`architecture` is what a resumed run must share with its checkpoint (the fields without :data:`RUNTIME`).

    ``layout="deepseek_v3"`` (docs/deepseek_layout.md) keeps these three attention variants but builds DeepSeek-V3
    blocks: RMSNorm, a SwiGLU MLP of ``d_ff``, no biases, no learned positions; MHA is Llama attention (RoPE over
    each whole head) and MLA adds DeepSeek's decoupled RoPE key of ``qk_rope_head_dim`` dims shared by all heads
    (cached beside the latent). Its MLA keeps exactly one RMSNorm right before the cache (``kv_a_layernorm``):
    ``latent_norm`` for MLA, ``kvsplice_norm`` for KVSplice, so a KVSplice-r model *is* an MLA model of latent r.
    """

    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    block_size: int = 1024
    dropout: float = field(default=0.0, metadata=RUNTIME)
    bias: bool = True
    attention: Attention = "mha"
    d_latent: int = 256
    kvsplice_keep: Optional[float] = None
    """MLA only: the fraction of the latent KVSplice keeps, in (0, 1) (0.1: KVSplice-90); ``None``: no KVSplice."""
    kvsplice_orthogonal: bool = False
    attn_backend: AttnBackend = field(default="auto", metadata=RUNTIME)
    mla_impl: MLAImpl = field(default="absorb", metadata=RUNTIME)
    """How MLA attends over cached latents: ``absorb`` folds w_uk / w_uv (and expand) into the query and output and
    attends in latent space; ``naive`` re-expands every cached latent into full K/V first (reference path)."""
    decode_kernel: DecodeKernel = field(default=DEFAULT_DECODE_KERNEL, metadata=RUNTIME)  # type: ignore[assignment]
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
    layout: Layout = "gpt2"
    """Block layout: ``gpt2`` (LayerNorm, GELU MLP, learned positions, biases) or ``deepseek_v3`` (RMSNorm, SwiGLU,
    RoPE, no biases; exports as DeepSeek-V3 (MLA) or Llama (MHA): ``kvsplice export --format``)."""
    qk_rope_head_dim: int = 0
    """``deepseek_v3`` MLA only: dims of the decoupled RoPE key (one per token, shared by all heads; DeepSeek's
    ``qk_rope_head_dim``) and of each head's RoPE query part; even, >= 2. 0 otherwise."""
    d_ff: Optional[int] = None
    """``deepseek_v3`` only: hidden width of the SwiGLU MLP (``intermediate_size``); ``8/3·d_model`` matches
    GPT-2's ``4·d_model`` GELU MLP in parameters. ``None`` in the GPT-2 layout (always ``4·d_model``)."""
    rope_theta: float = 10000.0
    """``deepseek_v3`` only: RoPE base (rotate-half layout; the DeepSeek export interleaves the RoPE columns)."""
    tie_embeddings: bool = True
    """The LM head shares the token embedding (GPT-2 always; ``deepseek_v3`` may untie: exports save it untied)."""
    cache_quant: Optional[str] = field(default=None, metadata=RUNTIME)
    """``None``: the decode cache holds the model's dtype; ``"int8"``: every cached row (K/V per head, or the
    latent) is stored as int8 with one fp16 absmax scale, dequantised inside the attention call. Decode only: the
    full forward (training) is unchanged."""

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        """Raise ``ValueError("GPTConfig.FIELD must be ...")``."""
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
        need(not self.kvsplice_norm or self.kvsplice_keep is not None, "kvsplice_norm",
             "false unless kvsplice_keep is set", self.kvsplice_norm)
        if self.kvsplice_keep is not None:
            r = self.kvsplice_keep
            need(isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 < r < 1.0, "kvsplice_keep",
                 "None or the fraction of the latent kept, 0 < keep < 1", r)
            need(self.attention == "mla", "kvsplice_keep", "None unless attention='mla' (KVSplice compresses the MLA "
                 "latent)", r)
            need(round(self.d_latent * r) >= 1, "kvsplice_keep", f"large enough that round(d_latent * keep) >= 1 "
                 f"(d_latent={self.d_latent})", r)
        self._check_layout(need)
        if self.attention == "mla":  # last: the checks above name the field the user actually got wrong
            need(self.d_latent <= self.d_model, "d_latent", f"<= d_model={self.d_model} for attention='mla' (the "
                 f"latent compresses K/V; a larger one would cache more than it saves)", self.d_latent)

    def _check_layout(self, need) -> None:
        need(self.layout in LAYOUTS, "layout", f"one of {LAYOUTS}", self.layout)
        rope = self.qk_rope_head_dim
        need(isinstance(rope, int) and not isinstance(rope, bool) and rope >= 0, "qk_rope_head_dim",
             "an integer >= 0", rope)
        need(isinstance(self.tie_embeddings, bool), "tie_embeddings", "true or false", self.tie_embeddings)
        if self.layout == GPT2:
            need(rope == 0, "qk_rope_head_dim", "0 in the gpt2 layout (learned positions, no RoPE)", rope)
            need(self.d_ff is None, "d_ff", "null in the gpt2 layout (its MLP is 4·d_model wide)", self.d_ff)
            need(self.tie_embeddings, "tie_embeddings", "true in the gpt2 layout", self.tie_embeddings)
            return
        need(not self.bias, "bias", "false in the deepseek_v3 layout (DeepSeek-V3 / Llama have no biases)",
             self.bias)
        need(isinstance(self.d_ff, int) and not isinstance(self.d_ff, bool) and self.d_ff >= 1, "d_ff",
             "an integer >= 1 in the deepseek_v3 layout (the SwiGLU width)", self.d_ff)
        need(self.head_size % 2 == 0, "d_model", "such that the head size is even (RoPE rotates pairs)",
             self.d_model)
        need(isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1, "rope_theta", "a number > 1",
             self.rope_theta)
        if self.attention == "mha":
            need(rope == 0, "qk_rope_head_dim", "0 for deepseek_v3 MHA (Llama: RoPE over each whole head)", rope)
            return
        need(rope >= 2 and rope % 2 == 0, "qk_rope_head_dim", "an even integer >= 2 for deepseek_v3 MLA (the "
             "decoupled RoPE key)", rope)
        spliced = self.kvsplice_keep is not None
        need(self.latent_norm != spliced, "latent_norm", f"{not spliced} for deepseek_v3 "
             f"{'MLA + KVSplice (the norm sits on the compressed latent: kvsplice_norm)' if spliced else 'MLA'}: "
             f"DeepSeek-V3 has exactly one latent RMSNorm, right before the cache", self.latent_norm)
        need(self.kvsplice_norm == spliced, "kvsplice_norm", f"{spliced} for deepseek_v3 "
             f"{'MLA + KVSplice (kv_a_layernorm on the compressed latent)' if spliced else 'MLA'}",
             self.kvsplice_norm)

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
        return None if self.kvsplice_keep is None else int(round(self.d_latent * self.kvsplice_keep))

    @property
    def variant(self) -> str:
        """Short name: ``mha``, ``gqa<n_kv_head>``, ``mqa``, ``mla`` or ``mla_kvsplice_<compression %>``; ``ds_``
        in front for the ``deepseek_v3`` layout."""
        prefix = "ds_" if self.layout == DEEPSEEK_V3 else ""
        if self.attention == "mha":
            kv = self.kv_heads
            return prefix + ("mha" if kv == self.n_head else "mqa" if kv == 1 else f"gqa{kv}")
        if self.kvsplice_keep is None:
            return prefix + "mla"
        return f"{prefix}mla_kvsplice_{round(100 * (1 - self.kvsplice_keep))}"

    @property
    def d_cached_latent(self) -> int:
        """MLA: dims of the latent the cache holds, ``d_compressed`` with KVSplice else ``d_latent`` (the
        DeepSeek-V3 export's ``kv_lora_rank``)."""
        return self.d_compressed if self.d_compressed is not None else self.d_latent

    @property
    def cache_dim(self) -> int:
        """Elements cached per token per layer: ``2·kv_heads·head_size`` (MHA/GQA/MQA; ``2·d_model`` for MHA),
        ``d_latent`` (MLA), ``d_compressed`` (KVSplice); plus ``qk_rope_head_dim`` (the RoPE key) for
        ``deepseek_v3`` MLA."""
        if self.attention == "mha":
            return 2 * self.kv_heads * self.head_size
        return self.d_cached_latent + self.qk_rope_head_dim

    @property
    def ff_width(self) -> int:
        """Hidden width of the MLP: ``d_ff`` (SwiGLU) or GPT-2's ``4·d_model``."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    def replace(self, **changes) -> "GPTConfig":
        """A copy with ``changes`` (checked like a new config)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def architecture(self) -> dict:
        """The fields that make the model what it is (all but the :data:`RUNTIME` ones): a resumed run, or one
        started from another's weights, must share them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("runtime")}

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        """The config a stored dict describes (a checkpoint's ``gpt_config``; old key names, :mod:`models.compat`, are
        read as the new ones; fields newer than the dict keep their defaults)."""
        d = rename_old_keys(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"GPTConfig got unknown fields {unknown}; known fields: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_file(cls, path: Union[str, "os.PathLike[str]"], **overrides: Any) -> "GPTConfig":
        """The ``model:`` section of a training YAML (``configs/*.yaml`` or a run's ``config.yaml``) as a config.

        LitGPT's training options (:data:`TRAINING_KEYS`: ``learning_rate``, ``warmup_steps``...) are skipped; any other
        key that is not a GPTConfig field is refused (a typo would otherwise run a default silently);
        a LightningCLI ``model: {class_path: ..., init_args: {...}}`` section is read from its ``init_args``.
        ``vocab_size`` is usually not in a training YAML (the CLI links it from the tokenizer): it then keeps the
        default unless given in ``overrides``, which replace any field.

        Raises:
            ValueError: the file is missing, is not YAML, has no ``model:`` mapping, or the values are invalid
                (the message names the file and the field).
        """
        import yaml

        from models.safe_yaml import YamlRefused, load_yaml_file

        p = Path(path).expanduser()
        try:
            data = load_yaml_file(p)
        except YamlRefused as e:
            raise ValueError(str(e)) from None
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
        unknown = sorted(k for k in model if k not in names and k not in TRAINING_KEYS and k not in OLD_NAMES)
        if unknown:
            raise ValueError(f"{p}: model.{unknown[0]} is not a model field nor a training option (fields: "
                             f"{', '.join(sorted(names))})")
        for old in OLD_NAMES:
            if old in model:
                warnings.warn(f"{p}: {old_name_note(old, model[old])}", FutureWarning, stacklevel=2)
        try:
            fields = {k: v for k, v in rename_old_keys(model, str(p)).items() if k in names}
            fields.update(overrides)
            return cls.from_dict(fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}: {e}" if not str(e).startswith(str(p)) else str(e)) from None

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "GPTConfig":
        """:meth:`from_file` of ``configs/NAME.yaml`` in the package's config folder (:data:`CONFIG_DIR`, found from
        the package location, not the current directory); a path to a YAML file works too.

        Raises:
            ConfigNotFoundError: no such config (the message lists the available names).
            ValueError: the file's ``model:`` section is invalid.
        """
        return cls.from_file(config_path(name), **overrides)


TRAINING_KEYS = ("vocab_multiple", "learning_rate", "weight_decay", "betas", "eps", "warmup_steps", "min_lr_ratio",
                 "init_from", "optimizer_impl", "compile", "splice_lr_mult")
"""LitGPT's own options in a training YAML's flat ``model:`` section (every other key is a :class:`GPTConfig` field)."""

PRESETS = ("gpt2", "gpt2_gqa4", "gpt2_mqa", "mla", "mla_kvsplice_50", "mla_kvsplice_70", "mla_kvsplice_90")
"""The GPT-2 124M configs (12 layers, 12 heads, d_model 768, block 1024, d_latent 256): MHA, GQA with 4 KV heads and
MQA (the baselines with a smaller standard cache), MLA and MLA + KVSplice 50/70/90. A preset *is* its training YAML
(``configs/NAME.yaml``): ``kvsplice verify-memory`` and ``kvsplice bench-decode`` measure exactly the model
``python -m training.fit --config NAME`` trains."""


def preset(name: str, **overrides) -> GPTConfig:
    """The ``model:`` section of ``configs/NAME.yaml`` for a 124M preset (:data:`PRESETS`), with optional field
    overrides; ``vocab_size`` is the padded GPT-2 vocabulary (50304) the training run links from its tokenizer."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig.from_name(name, **overrides)
