"""Decode steps replayed from a CUDA graph: one token per call at the cost of one graph launch.

An eager decode step of a 12-layer model launches a few hundred small kernels; at small batch or with a small cache
(MLA, KVSplice) the GPU then waits on Python and the launches, not on memory. :class:`GraphDecoder` captures one
step over a fixed-capacity view of the cache (:class:`models.static_cache.StaticCacheView`: same shapes every step)
and replays it. The result equals the eager step (``tests/models/test_graph_decode.py``); the cache's bytes are unchanged.
"""

from __future__ import annotations

import torch

from models.static_cache import StaticCacheView
from models.stream_cache import DecodeCache


class GraphDecoder:
    """``decoder.step(tok (B, 1)) -> logits (B, V)``: append one token to ``cache`` and return its next-token logits,
    by replaying a CUDA graph of ``model``'s step (the logits tensor is reused: copy it to keep it).

    ``cache`` must be a cache of ``model`` (int8 rows included) on a CUDA device whose capacity covers every token to decode
    (``model.new_cache(batch, capacity=...)``); it may already hold a prefilled prompt. ``cache.truncate(n)`` between
    steps rolls it back as usual.
    """

    def __init__(self, model: torch.nn.Module, cache: DecodeCache, *, warmup: int = 2) -> None:
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA-graph decode needs a CUDA cache, got {cache.device}")
        self.model, self.cache = model, cache
        self.view = StaticCacheView(cache)
        self.tok = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.device)  # (B, 1) static input
        self.view.sync()
        side = torch.cuda.Stream(cache.device)  # warm-up off the capture stream (library handles, kernel choice)
        side.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._step()
        torch.cuda.current_stream(cache.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()  # (B, V); the warm-up / capture rows at pos are overwritten by the first step

    @torch.inference_mode()
    def _step(self) -> torch.Tensor:
        self.view.begin_step()
        return self.model(self.tok, cache=self.view)[:, -1]  # (B, V)

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        block = getattr(getattr(self.model, "cfg", None), "block_size", None)
        if block is not None and self.cache.position + 1 > block:
            raise ValueError(f"sequence of {self.cache.position + 1} tokens exceeds block_size={block}")
        self.view.sync()  # pos from the cache's length (it may have been truncated)
        self.tok.copy_(tok)
        self.graph.replay()
        self.view.commit()
        return self.logits
