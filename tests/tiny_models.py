"""Helpers shared by the tests: tiny decode-test models with peaked attention, and the tiny training options."""

from __future__ import annotations

import torch


def sharpen(model: torch.nn.Module, std: float = 0.25, seed: int = 123) -> torch.nn.Module:
    """Weights larger than the default init so attention is peaked and logits spread (any error shows above 1e-4);
    norms near 1, biases small. Returns the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
    return model.eval()


TINY_FIT_ARGS = [
    "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "64", "--model.d_latent", "32",
    "--model.block_size", "64", "--data.batch_size", "8", "--data.val_batches", "4",
    "--data.synthetic_stories", "2000", "--data.synthetic_vocab_size", "512",
    "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1",
]
"""``python -m training.fit`` options for a seconds-long run on the embedded synthetic stories."""


def orthonormal_bases(n_layer: int, n_kv_head: int, head_dim: int, rank: int, rope: str, *, seed: int = 0,
                      identity: bool = False):
    """``KVBases`` whose every KV head has orthonormal bases (``k_enc = k_dec``, ``v_enc = v_dec``: the first
    ``rank`` columns of a random orthogonal matrix, or of the identity); full rank reconstructs exactly."""
    from kvsplice.lowrank.bases import HeadBases, KVBases

    g = torch.Generator().manual_seed(seed)

    def pair():
        q = torch.eye(head_dim) if identity else torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g))[0]
        return q[:, :rank].contiguous(), q[:, :rank].clone()

    layers = [[HeadBases(*pair(), *pair()) for _ in range(n_kv_head)] for _ in range(n_layer)]
    return KVBases(layers, "identity" if identity else "random", rope)


def save_model_dirs(models: dict, tokenizer, tmp_path_factory) -> dict:
    """``{name: folder}``: each model saved with ``save_pretrained`` beside ``tokenizer`` (a model directory the
    command-line tools load)."""
    out = {}
    for name, model in models.items():
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)
        out[name] = d
    return out


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3")
"""The HF decoder families the post-training methods support, as ``config.model_type``."""


def tiny_family(family: str, *, window: int | None = None, seed: int = 0, partial_rotary: float = 1.0,
                n_layer: int = 3, vocab_size: int = 96, std: float = 0.12) -> torch.nn.Module:
    """A tiny random-weight ``*ForCausalLM`` of ``family`` from its transformers config (no download), fp32, eval,
    :func:`sharpen`-ed (``std``): 3 layers, 4 query / 2 KV heads of 16, vocab 96 (``vocab_size``; 520 fits
    stories260K's tokenizer). ``window``: the sliding window — every layer for Mistral / Phi-3, layers 1.. for Qwen2/3
    (``max_window_layers=1``), layers 0 and 2 for Gemma-3 (layer 1 full); ``None`` = none. Gemma-3 also gets
    ``query_pre_attn_scalar`` 24, a local RoPE base of 100 and a final logit soft-cap of 30 (``gemma3``: that text
    model inside the multimodal ``Gemma3ForConditionalGeneration``, the last 3 token ids reserved for images); Qwen2
    q/k/v biases; Phi-3 ``partial_rotary``."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layer,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=window)
    elif family in ("qwen2", "qwen3"):
        cls = tf.Qwen2Config if family == "qwen2" else tf.Qwen3Config
        cfg = cls(**common, use_sliding_window=window is not None, sliding_window=window, max_window_layers=1)
    elif family == "phi3":
        cfg = tf.Phi3Config(**common, sliding_window=window, partial_rotary_factor=partial_rotary)
    elif family in ("gemma3_text", "gemma3"):
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
        cfg = tf.Gemma3TextConfig(**common, sliding_window=window or 4096, layer_types=types,
                                  query_pre_attn_scalar=24, rope_local_base_freq=100.0, final_logit_softcapping=30.0)
        if family == "gemma3":  # the multimodal Gemma3ForConditionalGeneration around it: a 1-layer vision tower
            vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14)
            cfg = tf.Gemma3Config(text_config=cfg, vision_config=vision, mm_tokens_per_image=4,
                                  image_token_index=vocab_size - 1, boi_token_index=vocab_size - 3,
                                  eoi_token_index=vocab_size - 2)
    else:
        raise ValueError(f"unknown family {family!r}")
    cfg._attn_implementation = "sdpa"
    model = sharpen(tf.AutoModelForCausalLM.from_config(cfg).float(), std=std, seed=seed)
    if family.startswith("gemma3"):  # Gemma's RMSNorms scale by 1 + weight: centre them on 1 like the others
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and "vision" not in name:
                    p.sub_(1.0)
    return model


def run_schedule(dec, ids, sizes):
    """Feed ``ids`` ``(B, T)`` through a fresh cache of the decoder ``dec`` in chunks of ``sizes`` (summing to T),
    checking the cache's length after each; returns the concatenated logits ``(B, T, V)`` and the cache."""
    cache = dec.new_cache(ids.shape[0])
    outs, s = [], 0
    for n in sizes:
        outs.append(dec(ids[:, s:s + n], cache))
        s += n
        assert cache.seq_len == s
    return torch.cat(outs, 1), cache


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as the module ``benchmarks.<name>`` (the repository is on the tests'
    ``sys.path``: pyproject's ``pythonpath``)."""
    import importlib

    return importlib.import_module(f"benchmarks.{name}")


def random_ids(seed: int, n: int) -> "torch.Tensor":
    """``(1, n)`` token ids in [3, 96) from ``seed`` (the tiny families' vocabulary, special ids left out)."""
    import torch

    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


class IdsTokenizer:
    """A tokenizer whose every text is the ids ``repeat`` ``(1, R)`` (KVzip's reconstruction instruction's)."""

    def __init__(self, repeat) -> None:
        self.repeat = repeat[0].tolist()

    def encode(self, text, add_special_tokens=True):
        return list(self.repeat)


def converted_tiny_llama(folder, **pads):
    """A random tiny Llama (GQA 4/2, head 16) converted to MLA (latent 16 + 16 shared RoPE dims) and saved as a
    DeepSeek-V3 folder at ``folder`` (``pads``: ``pad_latent`` / ``pad_rope`` for the padded export)."""
    import transformers

    from kvsplice.convert.deepseek_v3 import save_deepseek_v3
    from kvsplice.convert.llama_mla import calibrate_layers, convert_llama

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256,
                                   initializer_range=0.2)
    src = transformers.LlamaForCausalLM(cfg).eval()
    calib = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(1))
    mla = convert_llama(src, calibrate_layers(src, [calib]), d_latent=16, rope_dims=16, layout="shared")
    save_deepseek_v3(mla, folder, **pads)
    return src, mla
