"""keras_vit: the Vision Transformer for Keras 3 and TensorFlow."""

from keras_vit.checkpoints import (
    freeze_backbone,
    load_pretrained,
    replace_head,
    resample_position_embeddings,
    save_npz,
    set_image_size,
)
from keras_vit.layers import (
    MultiHeadSelfAttention,
    PatchEncoder,
    Patches,
    TokenPooling,
    TransformerBlock,
)
from keras_vit.model import build_vit
from keras_vit.resnet import BottleneckUnit, ResNetStem, StandardizedConv2D
# Registers the optimizers and schedules that trained models save with them.
from keras_vit import training  # noqa: F401
from keras_vit import flops  # noqa: F401
from keras_vit.variants import HYBRIDS, MODEL_SIZES, VARIANTS, ViTConfig, parse_variant

__version__ = "0.1.0"

__all__ = [
    "BottleneckUnit",
    "HYBRIDS",
    "ResNetStem",
    "StandardizedConv2D",
    "MODEL_SIZES",
    "MultiHeadSelfAttention",
    "PatchEncoder",
    "Patches",
    "TokenPooling",
    "TransformerBlock",
    "VARIANTS",
    "ViTConfig",
    "build_vit",
    "freeze_backbone",
    "load_pretrained",
    "replace_head",
    "resample_position_embeddings",
    "save_npz",
    "set_image_size",
    "parse_variant",
]
