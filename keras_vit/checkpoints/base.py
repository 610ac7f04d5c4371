"""What every part of the checkpoint code shares: the error, the keys more than one layout names, and the checks.

The bottom of `keras_vit.checkpoints`: it imports nothing of the package, and every other module may import it.
"""

import numpy as np

# The original checkpoints' learned position embeddings: (1, [1 +] patches, D), the class token's row first.
POSEMB = "Transformer/posembed_input/pos_embedding"
# An encoder block's self-attention in the original checkpoints (vit_jax's numbering of the block's sublayers).
BLOCK_ATTENTION = "MultiHeadDotProductAttention_1"
# big_vision's MAP head's cross-attention: `query`, `key`, `value`, `out` beneath it.
MAP_ATTENTION = "MAPHead_0/MultiHeadDotProductAttention_0"

# How position embeddings can be resampled to another patch grid (see `resample_position_embeddings`).
INTERPOLATIONS = ("bicubic", "bicubic_antialias", "bilinear", "zoom")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model."""


class PretrainedError(ValueError):
    """Pretrained weights that cannot be found or read into a model of this library."""


def check_interpolation(interpolation):
    """Raises a ValueError naming the choices unless `interpolation` is one of `INTERPOLATIONS`."""
    if interpolation not in INTERPOLATIONS:
        raise ValueError(
            f"`interpolation` must be one of {INTERPOLATIONS}. Received: interpolation={interpolation!r}"
        )


def square_side(n):
    """The side of a square grid of `n` cells (`n` patch rows of position embeddings); None if `n` is not a
    square number."""
    side = int(round(max(n, 0) ** 0.5))
    return side if n >= 0 and side * side == n else None


def check_array(value, key):
    """`value` as a NumPy array, or a CheckpointError naming `key` unless it is a real floating-point array of
    finite values (a string, integer, boolean, complex or object array, a NaN or an infinity is refused before
    anything is assigned)."""
    value = np.asarray(value)
    floating = np.issubdtype(value.dtype, np.floating) or value.dtype.name == "bfloat16"
    if not floating:
        raise CheckpointError(
            f"The checkpoint's {key!r} holds {value.dtype.name} values (shape {value.shape}); expected floating-point "
            "weights (float16, bfloat16, float32 or float64)."
        )
    finite = np.isfinite(value.astype(np.float32) if value.dtype.name == "bfloat16" else value)
    if not finite.all():
        raise CheckpointError(
            f"The checkpoint's {key!r} (shape {value.shape}) holds {int(finite.size - finite.sum())} NaN or infinite "
            "value(s); expected finite weights."
        )
    return value
