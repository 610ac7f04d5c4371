"""keras_vit: the Vision Transformer for Keras 3 and TensorFlow.

The public API. The model, its layers and the training recipes need Keras
only (any backend); `keras_vit.data`, `keras_vit.distribute`,
`keras_vit.export` and the checkpoints' file I/O need TensorFlow and are
imported by name.
"""

from keras_vit.checkpoints import (
    freeze_backbone,
    load_pretrained,
    replace_head,
    resample_position_embeddings,
    save_npz,
    set_image_size,
)
from keras_vit.flops import count_flops
from keras_vit.layers import (
    MultiHeadSelfAttention,
    PatchEncoder,
    Patches,
    TokenPooling,
    TransformerBlock,
)
from keras_vit.model import build_vit
from keras_vit.resnet import BottleneckUnit, ResNetStem, StandardizedConv2D
from keras_vit.training import SGD, AdamW, WarmupLinearDecay, learning_rate_schedule, make_optimizer
from keras_vit.variants import HYBRIDS, MODEL_SIZES, VARIANTS, ViTConfig, parse_variant

__version__ = "0.2.0"

__all__ = [
    "AdamW",
    "BottleneckUnit",
    "HYBRIDS",
    "MODEL_SIZES",
    "MultiHeadSelfAttention",
    "PatchEncoder",
    "Patches",
    "ResNetStem",
    "SGD",
    "StandardizedConv2D",
    "TokenPooling",
    "TransformerBlock",
    "VARIANTS",
    "ViTConfig",
    "WarmupLinearDecay",
    "build_vit",
    "count_flops",
    "freeze_backbone",
    "learning_rate_schedule",
    "load_pretrained",
    "make_optimizer",
    "parse_variant",
    "replace_head",
    "resample_position_embeddings",
    "save_npz",
    "set_image_size",
]
