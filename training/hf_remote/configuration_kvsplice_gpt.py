"""Config of an exported kvsplice GPT (MHA / grouped-query MHA, MLA, MLA + KVSplice); remote code, self-contained."""

from transformers import PretrainedConfig


class KVSpliceGPTConfig(PretrainedConfig):
    """The fields of the package's ``GPTConfig`` that define the weights and the cache.

    ``attention="mha"`` caches K and V of ``n_kv_head`` heads (``None``: ``n_head``); ``attention="mla"`` caches one
    latent of ``d_latent`` numbers per token and layer, or ``d_compressed`` with KVSplice; ``latent_norm`` applies
    an RMSNorm (eps ``latent_norm_eps``) to the latent before compressing / caching it.
    """

    model_type = "kvsplice_gpt"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "max_position_embeddings": "block_size"}

    def __init__(self, vocab_size=50304, n_layer=12, n_head=12, d_model=768, block_size=1024, bias=True,
                 attention="mha", n_kv_head=None, d_latent=256, d_compressed=None, latent_norm=False,
                 latent_norm_eps=1e-6, layer_norm_eps=1e-5, use_cache=True, **kwargs):
        self.vocab_size, self.n_layer, self.n_head, self.d_model = vocab_size, n_layer, n_head, d_model
        self.block_size, self.bias, self.attention, self.n_kv_head = block_size, bias, attention, n_kv_head
        self.d_latent, self.d_compressed, self.latent_norm = d_latent, d_compressed, latent_norm
        self.latent_norm_eps, self.layer_norm_eps = latent_norm_eps, layer_norm_eps
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    @property
    def head_size(self):
        return self.d_model // self.n_head

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def cache_dim(self):
        """Numbers cached per token and layer: ``2·n_kv_head·head_size`` (MHA), ``d_latent`` or ``d_compressed``."""
        if self.attention == "mha":
            return 2 * self.kv_heads * self.head_size
        return self.d_compressed if self.d_compressed is not None else self.d_latent
