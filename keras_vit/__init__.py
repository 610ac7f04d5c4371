"""keras_vit: the Vision Transformer for Keras 3 and TensorFlow.

The public API. The model, its layers and the training recipes need Keras
only (any backend), and so do `keras_vit.distribute`'s meshes (training over
a device mesh with `keras.distribution`); `keras_vit.data`, its strategies,
`keras_vit.export` and the checkpoints' file I/O need TensorFlow and are
imported by name.

Keras' default backend is TensorFlow: where that is the backend and no TensorFlow build is importable,
importing keras_vit fails first with an error that names the builds (`keras_vit.requirements`), before
Keras' own.
"""

from keras_vit.requirements import check_keras_backend

check_keras_backend()

from keras_vit.callbacks import EMAWeights, TensorBoardFigures
from keras_vit.checkpoints import (
    freeze_backbone,
    load_pretrained,
    replace_head,
    resample_position_embeddings,
    resize_patch_kernel,
    save_npz,
    save_timm,
    save_transformers,
    set_image_size,
    set_patch_size,
)
from keras_vit.distribute import check_model_parallel, get_layout_map, make_distribution
from keras_vit.evaluation import evaluate
from keras_vit.flops import count_flops
from keras_vit.layers import (
    MAPHead,
    MultiHeadSelfAttention,
    PatchEncoder,
    Patches,
    TokenPooling,
    TransformerBlock,
)
from keras_vit.mixing import BatchMixer, enable_batch_mixing
from keras_vit.model import ViT, build_vit
from keras_vit.preprocessing import Preprocessing
from keras_vit.pretrained import PretrainedError, from_pretrained
from keras_vit.resnet import BottleneckUnit, ResNetStem, StandardizedConv2D
from keras_vit.spec import ViTSpec
from keras_vit.train_step import TrainingSteps, enable_gradient_accumulation
from keras_vit.training import (
    SGD,
    AdamW,
    WarmupLinearDecay,
    layer_decay_scales,
    learning_rate_schedule,
    make_optimizer,
)
from keras_vit.variants import HYBRIDS, MODEL_SIZES, VARIANTS, ViTConfig, parse_variant

__version__ = "0.2.0"

__all__ = [
    "AdamW",
    "BatchMixer",
    "BottleneckUnit",
    "HYBRIDS",
    "MAPHead",
    "MODEL_SIZES",
    "MultiHeadSelfAttention",
    "PatchEncoder",
    "Preprocessing",
    "PretrainedError",
    "Patches",
    "ResNetStem",
    "SGD",
    "StandardizedConv2D",
    "TensorBoardFigures",
    "TokenPooling",
    "TrainingSteps",
    "TransformerBlock",
    "VARIANTS",
    "ViT",
    "ViTConfig",
    "ViTSpec",
    "WarmupLinearDecay",
    "build_vit",
    "check_model_parallel",
    "count_flops",
    "enable_batch_mixing",
    "enable_gradient_accumulation",
    "EMAWeights",
    "layer_decay_scales",
    "evaluate",
    "freeze_backbone",
    "from_pretrained",
    "get_layout_map",
    "learning_rate_schedule",
    "load_pretrained",
    "make_distribution",
    "make_optimizer",
    "parse_variant",
    "replace_head",
    "resample_position_embeddings",
    "resize_patch_kernel",
    "save_npz",
    "save_timm",
    "save_transformers",
    "set_image_size",
    "set_patch_size",
]
