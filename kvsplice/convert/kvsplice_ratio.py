"""How many latent dimensions a KVSplice ratio keeps, and the rule that refuses a ratio that keeps none.

KVSplice keeps ``round(R · ratio)`` of an ``R``-dimensional latent. A ratio must ask for at least one whole dimension
(``R · ratio >= 1``, i.e. ``ratio >= 1/R``): below it the latent would be rounded up to a dimension nobody asked for
(``--kvsplice-ratio 0.001`` of a 64-dim latent is 0.064 dimensions), which is a different compression than the one
requested and never a useful one. The rule depends on the latent only, so every door (``to_mla`` on a GPT
checkpoint or a Llama-family model, the library's :func:`~kvsplice.convert.mla.insert_kvsplice` and
:func:`~kvsplice.convert.llama_mla.shrink_latent`) checks it the same way, before any calibration.
"""

from __future__ import annotations

import math

__all__ = ["kept_dims"]


def kept_dims(ratio: float, d_latent: int, option: str = "kvsplice ratio") -> int:
    """``round(d_latent · ratio)``: the dimensions KVSplice keeps; a ``ValueError`` (one line, naming ``option``)
    when ``ratio`` is not in (0, 1) or asks for less than one whole dimension."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio < 1.0 \
            or not math.isfinite(ratio):
        raise ValueError(f"{option} must be in (0, 1) (the kept fraction of the latent), got {ratio!r}")
    if d_latent * ratio < 1:
        raise ValueError(f"{option} {ratio:g} of the {d_latent}-dim latent asks for {d_latent * ratio:.3g} dimensions; "
                         f"it must keep at least one whole dimension (ratio >= 1/{d_latent} = {1 / d_latent:.4g})")
    return round(d_latent * ratio)
