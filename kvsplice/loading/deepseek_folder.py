"""A DeepSeek-V3 folder (``config.json`` + safetensors, no pickle) read back into the package's own model, so that
every tool (the Decoder, the methods, ``kvsplice eval-tasks`` / ``generate`` / ``distill``, the cache-byte formula)
runs on an export before it is served.

| folder (``config.json``) | written by | loaded as |
|---|---|---|
| ``kvsplice.source`` (a converted Llama-family model) | ``kvsplice to-mla --format deepseek_v3`` | :class:`models.mla_llama.MLALlama` (shared RoPE) |
| ``kvsplice.variant``, or none: any dense MLA without q-LoRA | ``kvsplice export --format deepseek_v3`` | :class:`models.GPT` (``layout="deepseek_v3"``, MLA) |

The writers (:mod:`kvsplice.convert.deepseek_v3_writer` and its two families) are inverted exactly, up to float
round-off: the padded latent / RoPE key (:mod:`kvsplice.convert.latent_pad`, recorded in ``kvsplice.padded``) is cut
back, its zero rows checked; the interleaved RoPE rows go back to rotate-half; the softmax-scale fold leaves the
queries. A converted model's GQA (expanded per query head) is found again from the repeated ``kv_b_proj`` blocks,
its RoPE query map ``A_i`` (``q_rope = A_iᵀ q``) by least squares, and a norm-free model's linear-regime latent
(:func:`kvsplice.convert.deepseek_v3_llama.linear_regime`) is undone to the norm-free model with the source's eps.
A KVSplice-r GPT comes back as the MLA GPT of latent ``r`` it is (the same function and cache).

Refused with one line (``ValueError``): MoE layers, q-LoRA, RoPE scaling, biases, another activation, missing /
unexpected / wrongly shaped / non-finite weights, and padding that is not the writer's exact one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["DSAttention", "is_deepseek_v3_folder", "load_deepseek_v3", "read_deepseek_v3"]

MODEL_TYPE = "deepseek_v3"


def is_deepseek_v3_folder(folder: Path) -> bool:
    """``folder/config.json`` names ``model_type: deepseek_v3``."""
    try:
        return json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


# ================================================================================================ config and files
def _refuse_foreign(c: dict[str, Any], where: str) -> None:
    """ValueError naming the first setting no model of the package has."""
    n = c.get("num_hidden_layers")
    moe = c.get("first_k_dense_replace", n)
    why = None
    if isinstance(moe, int) and isinstance(n, int) and moe < n:
        why = f"MoE layers (first_k_dense_replace {moe} < {n} layers)"
    elif c.get("q_lora_rank") is not None:
        why = f"a low-rank query (q_lora_rank {c['q_lora_rank']})"
    elif c.get("rope_scaling") or (c.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        why = "RoPE scaling (rope_scaling / rope_parameters)"
    elif c.get("attention_bias"):
        why = "attention biases"
    elif c.get("hidden_act", "silu") != "silu":
        why = f"hidden_act {c.get('hidden_act')!r}"
    elif c.get("v_head_dim") != c.get("qk_nope_head_dim"):
        why = f"v_head_dim {c.get('v_head_dim')} != qk_nope_head_dim {c.get('qk_nope_head_dim')}"
    if why:
        raise ValueError(f"{where} is a DeepSeek-V3 model with {why}: the kvsplice tools load the dense MLA folders "
                         f"`kvsplice to-mla --format deepseek_v3` and `kvsplice export --format deepseek_v3` write")


def _int(c: dict[str, Any], key: str, where: str) -> int:
    v = c.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{where}/config.json: {key} must be a whole number >= 1, got {v!r}")
    return v


def _shapes(c: dict[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """Every weight's shape the config describes (transformers' DeepSeek-V3 names)."""
    v, d, n, h = (_int(c, k, where) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    hd, dr, p, ff = (_int(c, k, where) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank",
                                                 "intermediate_size"))
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not c.get("tie_word_embeddings"):
        out["lm_head.weight"] = (v, d)
    for i in range(n):
        pre = f"model.layers.{i}."
        out.update({pre + "self_attn.q_proj.weight": (h * (hd + dr), d),
                    pre + "self_attn.kv_a_proj_with_mqa.weight": (p + dr, d),
                    pre + "self_attn.kv_a_layernorm.weight": (p,), pre + "self_attn.kv_b_proj.weight": (h * 2 * hd, p),
                    pre + "self_attn.o_proj.weight": (d, h * hd), pre + "input_layernorm.weight": (d,),
                    pre + "post_attention_layernorm.weight": (d,), pre + "mlp.gate_proj.weight": (ff, d),
                    pre + "mlp.up_proj.weight": (ff, d), pre + "mlp.down_proj.weight": (d, ff)})
    return out


def _read_weights(folder: Path, c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The folder's weights (``model.safetensors`` or the shards of ``model.safetensors.index.json``), checked
    against the config: names, shapes, finite floats (one line, as :func:`kvsplice.loading.gguf.refuse_incomplete`)."""
    from safetensors.torch import load_file

    from kvsplice.loading.gguf import refuse_incomplete
    from models.checkpoint import check_tensor

    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        files = [folder / f for f in sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))]
    else:
        raise ValueError(f"{folder} holds no model.safetensors (the kvsplice tools read no pickled weights)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    want = _shapes(c, str(folder))
    info = {"missing_keys": sorted(set(want) - set(sd)), "unexpected_keys": sorted(set(sd) - set(want)),
            "mismatched_keys": sorted(k for k in set(want) & set(sd) if tuple(sd[k].shape) != want[k])}
    refuse_incomplete(info, str(folder))
    for name, t in sd.items():
        check_tensor(t, str(folder), name)
    return sd


# ================================================================================================ one layer
@dataclass
class DSAttention:
    """One layer's attention in DeepSeek-V3's terms, unpadded, RoPE rows rotate-half, fp64; the queries scaled so
    that the scores are ``(D + Dr)^-½ (q_nope·k_nope + rope(q_rope)·rope(k_rope))`` (the unpadded model's)."""

    q_nope: torch.Tensor  # (H, D, d)
    q_rope: torch.Tensor  # (H, Dr, d)
    down: torch.Tensor  # (r, d)
    norm: torch.Tensor  # (r,)
    k_rope: torch.Tensor  # (Dr, d)
    w_uk: torch.Tensor  # (H, D, r)
    w_uv: torch.Tensor  # (H, D, r)


def _padding(c: dict[str, Any], where: str) -> tuple[int, int]:
    """The unpadded ``(r, Dr)`` (``kvsplice.padded``: ``[model's, written]``), checked against the written row."""
    pad = ((c.get("kvsplice") or {}).get("padded") or {})
    out = []
    for key in ("kv_lora_rank", "qk_rope_head_dim"):
        written = c[key]
        small, big = pad.get(key, [written, written])
        if not (isinstance(small, int) and 1 <= small <= written == big) or (key[0] == "q" and (
                written % small or small % 2)):
            raise ValueError(f"{where}/config.json: kvsplice.padded.{key} {pad.get(key)} is not a padding of "
                             f"{key} {written} the exporter writes")
        out.append(small)
    return out[0], out[1]


def _unpad_latent(down, norm, kv_b, r: int, where: str, i: int):
    """Invert :func:`kvsplice.convert.latent_pad.pad_normed_latent` / ``pad_columns``."""
    p = down.shape[0]
    if r == p:
        return down, norm, kv_b
    if down[r:].any() or norm[r:].any() or kv_b[..., r:].any():
        raise ValueError(f"{where}: layer {i}'s latent beyond kv_lora_rank {r} is not zero: not the exporter's "
                         f"exact padding")
    a = math.sqrt(p / r)
    return down[:r] / a, norm[:r] * a, kv_b[..., :r]


def _unspread(w: torch.Tensor, dr: int, interleaved: bool, where: str, i: int) -> torch.Tensor:
    """Invert :func:`kvsplice.convert.latent_pad.spread_rope_rows` and the interleave: ``w (..., Dr', d)`` to
    ``(..., Dr, d)`` in rotate-half order."""
    k = w.shape[-2] // dr
    pairs = w.unflatten(-2, (dr // 2, k, 2))  # (..., Dr/2, k, 2, d): pair k·i of the padded key is pair i
    if k > 1 and pairs[..., 1:, :, :].any():
        raise ValueError(f"{where}: layer {i}'s RoPE rows beyond the model's {dr} are not zero: not the exporter's "
                         f"exact padding")
    pairs = pairs[..., 0, :, :]  # (..., Dr/2, 2, d): pair i = (x_i, y_i)
    return (pairs.transpose(-3, -2) if interleaved else pairs).flatten(-3, -2)  # [x_0..x_n ; y_0..y_n]


def _attention(sd, c: dict[str, Any], i: int, r: int, dr: int, where: str) -> DSAttention:
    h, hd, p, drp = c["num_attention_heads"], c["qk_nope_head_dim"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    pre = f"model.layers.{i}.self_attn."
    q = sd[pre + "q_proj.weight"].double().view(h, hd + drp, -1)  # (H, D + Dr', d)
    a = sd[pre + "kv_a_proj_with_mqa.weight"].double()  # (P + Dr', d)
    kv_b = sd[pre + "kv_b_proj.weight"].double().view(h, 2 * hd, p)  # (H, [k_nope ; v], P)
    down, norm, kv_b = _unpad_latent(a[:p], sd[pre + "kv_a_layernorm.weight"].double(), kv_b, r, where, i)
    inter = bool(c.get("rope_interleave", True))
    unfold = math.sqrt((hd + dr) / (hd + drp))  # DeepSeek's (D + Dr')^-½ back to (D + Dr)^-½
    return DSAttention(q_nope=q[:, :hd] * unfold, q_rope=_unspread(q[:, hd:], dr, inter, where, i) * unfold,
                       down=down, norm=norm, k_rope=_unspread(a[p:], dr, inter, where, i),
                       w_uk=kv_b[:, :hd], w_uv=kv_b[:, hd:])


def _theta(c: dict[str, Any]) -> float:
    return float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def _tied(sd) -> bool:
    return "lm_head.weight" not in sd or torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def _block_common(sd, i: int) -> dict[str, torch.Tensor]:
    pre = f"model.layers.{i}."
    return {k: sd[pre + k] for k in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                     "mlp.down_proj.weight")}


# ================================================================================================ the two families
def _as_gpt(sd, c: dict[str, Any], layers: list[DSAttention], dtype: torch.dtype, where: str):
    """A trained ``layout="deepseek_v3"`` MLA GPT (:mod:`kvsplice.convert.deepseek_v3_gpt` inverted)."""
    from models.config import RMS_NORM_EPS, GPTConfig
    from models.gpt import GPT

    h, hd, eps = c["num_attention_heads"], c["qk_nope_head_dim"], float(c.get("rms_norm_eps", RMS_NORM_EPS))
    why = (f"{h} heads x qk_nope_head_dim {hd} != hidden_size {c['hidden_size']}" if h * hd != c["hidden_size"] else
           f"rms_norm_eps {eps:g} (the GPT's norms use {RMS_NORM_EPS:g})" if abs(eps - RMS_NORM_EPS) > 1e-12 else None)
    if why:
        raise ValueError(f"{where} has {why}: not a model `kvsplice export --format deepseek_v3` writes, nor (no "
                         f"kvsplice.source in config.json) one `kvsplice to-mla --format deepseek_v3` writes")
    try:
        cfg = GPTConfig(vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"], n_head=h, d_model=c["hidden_size"],
                        block_size=_int(c, "max_position_embeddings", where), bias=False, attention="mla",
                        d_latent=layers[0].down.shape[0], latent_norm=True, layout="deepseek_v3",
                        qk_rope_head_dim=layers[0].k_rope.shape[0], d_ff=c["intermediate_size"],
                        rope_theta=_theta(c), tie_embeddings=_tied(sd))
    except ValueError as e:
        raise ValueError(f"{where} does not map onto the package's DeepSeek-V3 GPT: {e}") from None
    emb = sd["model.embed_tokens.weight"]
    out = {"transformer.wte.weight": emb, "transformer.ln_f.weight": sd["model.norm.weight"],
           "lm_head.weight": sd.get("lm_head.weight", emb)}
    names = {"input_layernorm.weight": "ln_1.weight", "post_attention_layernorm.weight": "ln_2.weight",
             "self_attn.o_proj.weight": "attn.c_proj.weight"}
    for i, ly in enumerate(layers):
        pre = f"transformer.h.{i}."
        out.update({pre + names.get(k, k): w for k, w in _block_common(sd, i).items()})
        out.update({pre + "attn.w_q.weight": ly.q_nope.flatten(0, 1), pre + "attn.w_qr.weight": ly.q_rope.flatten(0, 1),
                    pre + "attn.w_kr.weight": ly.k_rope, pre + "attn.w_dkv.weight": ly.down,
                    pre + "attn.kv_norm.weight": ly.norm, pre + "attn.w_uk.weight": ly.w_uk.flatten(0, 1),
                    pre + "attn.w_uv.weight": ly.w_uv.flatten(0, 1)})
    model = GPT(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in out.items()})
    return model


def _kv_groups(layers: list[DSAttention], h: int) -> int:
    """KV heads of the source: the fewest ``n`` whose blocks of ``h / n`` query heads repeat one ``kv_b_proj`` block
    (the writer's ``repeat_interleave``) in every layer."""
    for n in range(1, h + 1):
        if h % n == 0 and all(torch.equal(w, w[::h // n].repeat_interleave(h // n, 0))
                              for ly in layers for w in (ly.w_uk, ly.w_uv)):
            return n
    return h


def _as_mla_llama(sd, c: dict[str, Any], layers: list[DSAttention], dtype: torch.dtype, where: str):
    """A converted Llama-family model (:mod:`kvsplice.convert.deepseek_v3_llama` inverted)."""
    from models.mla_llama import MLALlama, MLALlamaConfig

    ks = c["kvsplice"]
    h, hd, n = c["num_attention_heads"], c["qk_nope_head_dim"], c["num_hidden_layers"]
    r, dr = layers[0].down.shape[0], layers[0].k_rope.shape[0]
    linear = "latent_norm_eps" not in ks  # the linear regime of a norm-free model: undone below
    eps = float(c["rms_norm_eps"])  # the linear regime's ε too
    kv = _kv_groups(layers, h)
    cfg = MLALlamaConfig(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layer=n, n_head=h, n_kv_head=kv,
                         head_dim=hd, d_ff=c["intermediate_size"], d_latent=r, rope_dims=dr, rope_layout="shared",
                         latent_norm=not linear,
                         norm_eps=float(ks.get("source_rms_norm_eps", eps) if linear else eps),
                         latent_norm_eps=float(ks.get("latent_norm_eps", eps)),
                         max_positions=_int(c, "max_position_embeddings", where), tie_embeddings=_tied(sd),
                         source=dict(ks.get("source") or {}))
    model = MLALlama(cfg)
    inv = 1.0 / _theta(c) ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr)  # (Dr/2,): DeepSeek's table
    to_d = math.sqrt(hd / (hd + dr))  # scores at (D + Dr)^-½ -> the model's D^-½ (softmax_scale None)
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "lm_head.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}
    for i, ly in enumerate(layers):
        s2 = 1.0  # γ of the linear regime: norm weight sqrt(ε)/γ; s = sqrt(γ) moved into the input norm
        if linear:
            if not torch.allclose(ly.norm, ly.norm[:1].expand_as(ly.norm), rtol=1e-6, atol=0) or ly.norm[0] <= 0:
                raise ValueError(f"{where}: layer {i}'s kv_a_layernorm is not the linear regime its config.json "
                                 f"names (one positive value)")
            s2 = float(eps ** 0.5 / ly.norm.mean())
        s = math.sqrt(s2)
        q = ly.q_nope * (to_d * s)  # (H, D, d)
        qr = ly.q_rope * (to_d * s)  # (H, Dr, d) = A_iᵀ q_i
        sol = torch.linalg.lstsq(q.transpose(1, 2), qr.transpose(1, 2)).solution  # (H, D, Dr): A_i
        err = (torch.einsum("hde,hdm->hem", sol, q) - qr).norm() / qr.norm().clamp_min(1e-30)
        if err > 1e-4:
            raise ValueError(f"{where}: layer {i}'s RoPE queries are not a map of its head queries (relative error "
                             f"{err:.1e}): not a converted model's export")
        k_proj = ly.k_rope.new_zeros(kv * hd, ly.k_rope.shape[1])  # (Hkv·D, d): the RoPE key's rows, then zeros
        k_proj[:dr] = ly.k_rope * s
        pre = f"layers.{i}."
        common = _block_common(sd, i)
        out.update({pre + "input_norm.weight": common["input_layernorm.weight"].double() / s,
                    pre + "post_norm.weight": common["post_attention_layernorm.weight"],
                    pre + "attn.o_proj.weight": common["self_attn.o_proj.weight"],
                    pre + "attn.q_proj.weight": q.flatten(0, 1), pre + "attn.k_proj.weight": k_proj,
                    pre + "attn.w_dkv.weight": ly.down * (s / s2 if linear else 1.0),
                    pre + "attn.w_uk.weight": ly.w_uk[::h // kv].flatten(0, 1),
                    pre + "attn.w_uv.weight": ly.w_uv[::h // kv].flatten(0, 1),
                    pre + "attn.q_rope": sol, pre + "attn.k_rope": torch.eye(kv * hd, dr, dtype=torch.float64),
                    pre + "attn.inv_freq": inv[None]})
        if not linear:
            out[pre + "attn.kv_norm.weight"] = ly.norm
        out.update({pre + k.split(".")[1] + ".weight": common[k] for k in
                    ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")})
    model.load_state_dict({k: v.to(torch.float32 if k.endswith(("q_rope", "k_rope", "inv_freq")) else dtype)
                           for k, v in out.items()})
    return model


# ================================================================================================ front door
def read_deepseek_v3(folder: Path, *, dtype: Optional[torch.dtype] = None):
    """The package's model a DeepSeek-V3 folder holds (module docstring), in eval mode; ValueError, one line."""
    folder = Path(folder)
    where = str(folder)
    c = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    _refuse_foreign(c, where)
    sd = _read_weights(folder, c)
    r, dr = _padding(c, where)
    layers = [_attention(sd, c, i, r, dr, where) for i in range(c["num_hidden_layers"])]
    stored = sd["model.embed_tokens.weight"].dtype
    build = _as_mla_llama if "source" in (c.get("kvsplice") or {}) else _as_gpt
    model = build(sd, c, layers, stored, where).eval()
    return model.to(dtype) if dtype is not None else model


def load_deepseek_v3(folder: Path, *, tokenizer: Optional[str] = None, dtype: Optional[torch.dtype] = None):
    """``(model, tokenizer)`` for :func:`kvsplice.loading.load_model` (``LoadError``, one line)."""
    from kvsplice.io.cli import first_line
    from kvsplice.loading.errors import LoadError
    from kvsplice.loading.tokenizers import load_tokenizer

    try:
        model = read_deepseek_v3(folder, dtype=dtype)
    except (ValueError, OSError, KeyError, TypeError, RuntimeError) as e:
        raise LoadError(first_line(e) if isinstance(e, ValueError) else
                        f"cannot load the DeepSeek-V3 model in {folder}: {first_line(e)}") from None
    if tokenizer is None and not (Path(folder) / "tokenizer_config.json").is_file():
        raise LoadError(f"{folder} holds no tokenizer (tokenizer_config.json); pass --tokenizer")
    return model, load_tokenizer(tokenizer if tokenizer is not None else folder)
