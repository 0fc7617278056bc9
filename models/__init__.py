"""GPT-2 variants: standard MHA, Multi-head Latent Attention, and MLA + KVSplice."""

from models.config import GPTConfig, PRESETS, preset
from models.gpt import GPT

__all__ = ["GPT", "GPTConfig", "PRESETS", "preset"]
