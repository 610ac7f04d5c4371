"""keras_vit: the Vision Transformer for Keras 3 and TensorFlow."""

from keras_vit.layers import (
    MultiHeadSelfAttention,
    PatchEncoder,
    Patches,
    TokenPooling,
    TransformerBlock,
)
from keras_vit.model import build_vit
from keras_vit.variants import MODEL_SIZES, VARIANTS, ViTConfig, parse_variant

__version__ = "0.1.0"

__all__ = [
    "MODEL_SIZES",
    "MultiHeadSelfAttention",
    "PatchEncoder",
    "Patches",
    "TokenPooling",
    "TransformerBlock",
    "VARIANTS",
    "ViTConfig",
    "build_vit",
    "parse_variant",
]
