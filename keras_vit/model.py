"""`build_vit`: the Vision Transformer as a functional Keras model.

Layer names are stable; the checkpoint converters map onto them:

| layer | weights | original checkpoint |
|---|---|---|
| `rescaling` (if `include_rescaling`) | none | pixels / 127.5 - 1, or (pixels / 255 - mean) / std |
| `resnet` (hybrids only) | see `keras_vit.resnet` | `conv_root`, `gn_root`, `block{s}/unit{u}/*` |
| `patch_encoder` | `kernel`, `bias`, `class_token`, `position_embedding` (learned) | `embedding/*`, `cls`, posembed |
| `embedding_dropout` | none | dropout after the position embeddings |
| `pre_norm` (if `pre_norm`) | `gamma`, `beta` | `pre_norm/{scale,bias}` (timm's `norm_pre`) |
| `encoderblock_{i}` (i = 0 .. L-1) | see `TransformerBlock` | `Transformer/encoderblock_{i}/*` |
| `encoder_norm` (unless `pooled_norm`) | `gamma`, `beta` | `Transformer/encoder_norm/{scale,bias}` |
| `pooling` | none; `MAPHead`'s (classifier "map") | class token or mean of the tokens; `MAPHead_0/*` |
| `pooled_norm` (if `pooled_norm`) | `gamma`, `beta` | `pooled_norm/{scale,bias}` (timm's `fc_norm`) |
| `pre_logits` (if `representation_size`) | `kernel`, `bias` | `pre_logits/*` |
| `head` (if `num_classes`) | `kernel`, `bias` | `head/*` |

`posembed` stands for `Transformer/posembed_input/pos_embedding`.

Inside `encoderblock_{i}`: `attention_norm` (LayerNorm_0), `attention`
(MultiHeadDotProductAttention_1; `qkv_kernel` (D, 3, D) is the query, key and
value kernels, each reshaped to (D, D), stacked on the middle axis, so its last
axis is heads x head_dim), `mlp_norm` (LayerNorm_2), `mlp_dense_1` and
`mlp_dense_2` (MlpBlock_3/Dense_0, Dense_1).
"""

import keras
import numpy as np

from keras_vit import layers as vit_layers
from keras_vit.layers.common import check_rate
from keras_vit.layers.core import gelu_activation
from keras_vit.resnet import ResNetStem
from keras_vit.variants import parse_variant, to_pair

CLASSIFIERS = ("token", "gap", "map")
POSITION_EMBEDDINGS = vit_layers.PatchEncoder.POSITION_EMBEDDINGS


def _check_optional_positive(name, value):
    if value is None or value == 0:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"`{name}` must be a positive integer, or None. Received: {name}={value!r}"
        )
    return value


def _default_name(variant):
    return "vit_" + "".join(c for c in variant.lower() if c.isalnum())


def build_vit(
    variant,
    *,
    image_size=224,
    dynamic_image_size=False,
    num_classes=1000,
    classifier="token",
    representation_size=None,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    stochastic_depth_rate=0.0,
    include_rescaling=True,
    pixel_mean=None,
    pixel_std=None,
    num_channels=3,
    head_kernel_initializer="zeros",
    patch_projection="conv",
    gelu="exact",
    position_embedding="learned",
    pre_norm=False,
    pooled_norm=False,
    layer_norm_epsilon=1e-6,
    name=None,
    **overrides,
):
    """Builds a Vision Transformer (Dosovitskiy et al. 2020).

    Args:
        variant: paper notation, e.g. "Ti/16", "S/16", "B/16", "L/32", "H/14",
            or "testing" (a tiny model for tests); see `keras_vit.VARIANTS`.
        image_size: int or (height, width), each divisible by the patch size.
        dynamic_image_size: the model takes images of any height and width
            that divide by the patch size (timm's `dynamic_img_size`): its
            weights are those of `image_size`, and learned position
            embeddings are resampled to each input's patch grid in the graph
            (bicubic with antialias, as timm).  The input shape is then
            (batch, None, None, channels).
        num_classes: width of the classification head; None or 0 returns the
            pooled (pre-logits) features instead: a backbone.
        classifier: "token" (the class token), "gap" (mean of the patch
            tokens) or "map" (big_vision's multi-head attention pooling,
            `MAPHead`); with "gap" and "map" the model has no class token.
        representation_size: if set, a Dense + tanh "pre-logits" layer of this
            width before the head (used when pre-training on ImageNet-21k).
        dropout_rate: dropout after the embeddings, the attention and in the MLPs.
        attention_dropout_rate: dropout on the attention probabilities.
        stochastic_depth_rate: drop-path rate of the last block; block i uses
            `stochastic_depth_rate * i / (num_layers - 1)` (linear rule).
        include_rescaling: map input pixels from [0, 255] to [-1, 1]
            (x / 127.5 - 1) inside the model, as the original checkpoints
            expect; the model then takes raw pixels, uint8 or float.
        pixel_mean, pixel_std: with `include_rescaling`, the per-channel
            mean and standard deviation of pixels scaled to [0, 1] that the
            weights were trained with: the model computes
            (x / 255 - mean) / std (DeiT's and timm's ImageNet statistics,
            (0.485, 0.456, 0.406) and (0.229, 0.224, 0.225); CLIP's).  Both
            None: 0.5 and 0.5, the [-1, 1] of the original weights.
        num_channels: channels of the input images.
        head_kernel_initializer: initializer of the head's kernel; zeros as in
            the original implementation (what fine-tuning wants).
        patch_projection: "conv" or "matmul", see `PatchEncoder`.
        gelu: the MLPs' GELU: "exact" (x * Phi(x)) or "tanh", the
            approximation the original implementation and big_vision compute
            (Flax's `nn.gelu`): build with "tanh" to reproduce an original
            checkpoint's outputs to float precision.
        position_embedding: "learned" (the paper's) or "sincos2d" (fixed 2-D
            sin-cos embeddings computed from the patch grid, big_vision's
            "Better plain ViT baselines"; no weights, hidden_dim a multiple of 4).
        pre_norm: a LayerNorm on the tokens before the first block (timm's
            `norm_pre`, CLIP's layout).
        pooled_norm: the final LayerNorm on the pooled features instead of on
            the tokens (timm's `fc_norm`, its default for GAP models).
        layer_norm_epsilon: every LayerNorm's epsilon: 1e-6 as the original
            implementation, big_vision and most of timm; timm's CLIP models
            use 1e-5, transformers' `google/vit-*` configs 1e-12.
        name: model name, by default derived from the variant ("vit_b16").
        **overrides: `hidden_dim`, `num_layers`, `num_heads`, `mlp_dim`,
            `patch_size`; they win over the variant's table entry.

    Returns:
        A functional `keras.Model` mapping (batch, height, width, channels)
        images to float32 logits (batch, num_classes), or to the pooled
        features when `num_classes` is None.

    >>> model = build_vit("testing", image_size=32, num_classes=10)
    >>> model.output_shape
    (None, 10)
    """
    config = parse_variant(variant, **overrides)
    height, width = to_pair(image_size, "image_size")
    stride = 1 if config.resnet_layers is None else ResNetStem.stride(config.resnet_layers)
    if height % (stride * config.patch_size[0]) or width % (stride * config.patch_size[1]):
        hybrid = f" times the ResNet stride {stride}" if config.resnet_layers is not None else ""
        raise ValueError(
            f"`image_size` must be divisible by the patch size{hybrid}. Received: image_size="
            f"{image_size!r}, patch_size={config.patch_size} (variant {variant!r})"
        )
    if classifier not in CLASSIFIERS:
        raise ValueError(
            f"`classifier` must be one of {CLASSIFIERS}. Received: classifier={classifier!r}"
        )
    if position_embedding not in POSITION_EMBEDDINGS:
        raise ValueError(
            f"`position_embedding` must be one of {POSITION_EMBEDDINGS}. Received: "
            f"position_embedding={position_embedding!r}"
        )
    num_classes = _check_optional_positive("num_classes", num_classes)
    representation_size = _check_optional_positive("representation_size", representation_size)
    if not isinstance(num_channels, int) or isinstance(num_channels, bool) or num_channels < 1:
        raise ValueError(
            f"`num_channels` must be a positive integer. Received: num_channels={num_channels!r}"
        )
    gelu_activation(gelu)
    for flag_name, flag in (("pre_norm", pre_norm), ("pooled_norm", pooled_norm)):
        if not isinstance(flag, bool):
            raise ValueError(f"`{flag_name}` must be True or False. Received: {flag_name}={flag!r}")
    if not isinstance(layer_norm_epsilon, (int, float)) or isinstance(layer_norm_epsilon, bool) or not (
        0 < layer_norm_epsilon < 1
    ):
        raise ValueError(
            f"`layer_norm_epsilon` must be a number in (0, 1). Received: layer_norm_epsilon={layer_norm_epsilon!r}"
        )
    epsilon = float(layer_norm_epsilon)
    for rate_name, rate in (
        ("dropout_rate", dropout_rate),
        ("attention_dropout_rate", attention_dropout_rate),
        ("stochastic_depth_rate", stochastic_depth_rate),
    ):
        check_rate(rate_name, rate)

    # === Layers ===
    if not isinstance(dynamic_image_size, bool):
        raise ValueError(
            f"`dynamic_image_size` must be True or False. Received: dynamic_image_size={dynamic_image_size!r}"
        )
    input_size = (None, None) if dynamic_image_size else (height, width)
    images = keras.Input((*input_size, num_channels), name="images")
    x = images
    if include_rescaling:
        x = _rescaling(pixel_mean, pixel_std, num_channels)(x)
    elif pixel_mean is not None or pixel_std is not None:
        raise ValueError(
            "`pixel_mean` and `pixel_std` need include_rescaling=True. Received: include_rescaling=False"
        )
    if config.resnet_layers is not None:
        x = ResNetStem(config.resnet_layers, name="resnet")(x)
    x = vit_layers.PatchEncoder(
        config.hidden_dim,
        config.patch_size,
        use_class_token=classifier == "token",
        projection=patch_projection,
        position_embedding=position_embedding,
        base_image_size=(height // stride, width // stride) if dynamic_image_size else None,
        name="patch_encoder",
    )(x)
    x = vit_layers.Dropout(dropout_rate, name="embedding_dropout")(x)
    if pre_norm:
        x = vit_layers.LayerNormalization(epsilon=epsilon, name="pre_norm")(x)
    for i in range(config.num_layers):
        depth_fraction = i / (config.num_layers - 1) if config.num_layers > 1 else 1.0
        x = vit_layers.TransformerBlock(
            num_heads=config.num_heads,
            mlp_dim=config.mlp_dim,
            dropout_rate=dropout_rate,
            attention_dropout_rate=attention_dropout_rate,
            stochastic_depth_rate=stochastic_depth_rate * depth_fraction,
            gelu=gelu,
            layer_norm_epsilon=epsilon,
            name=f"encoderblock_{i}",
        )(x)
    if not pooled_norm:
        x = vit_layers.LayerNormalization(epsilon=epsilon, name="encoder_norm")(x)
    if classifier == "map":
        x = vit_layers.MAPHead(
            config.num_heads, config.mlp_dim, gelu=gelu, layer_norm_epsilon=epsilon, name="pooling"
        )(x)
    else:
        x = vit_layers.TokenPooling(classifier, name="pooling")(x)
    if pooled_norm:
        x = vit_layers.LayerNormalization(epsilon=epsilon, name="pooled_norm")(x)
    if representation_size:
        x = keras.layers.Dense(representation_size, activation="tanh", name="pre_logits")(x)
    if num_classes:
        # float32 logits under any policy: softmax and the loss need the range.
        x = keras.layers.Dense(
            num_classes,
            kernel_initializer=head_kernel_initializer,
            dtype="float32",
            name="head",
        )(x)
    return keras.Model(images, x, name=name or _default_name(variant))


def _rescaling(pixel_mean, pixel_std, num_channels):
    """The layer mapping raw pixels to what the weights expect: [-1, 1], or (x / 255 - mean) / std."""
    if pixel_mean is None and pixel_std is None:
        return keras.layers.Rescaling(1.0 / 127.5, offset=-1.0, name="rescaling")
    if pixel_mean is None or pixel_std is None:
        raise ValueError(
            "`pixel_mean` and `pixel_std` go together. Received: "
            f"pixel_mean={pixel_mean!r}, pixel_std={pixel_std!r}"
        )
    try:
        mean, std = (np.broadcast_to(np.asarray(v, np.float64), (num_channels,)) for v in (pixel_mean, pixel_std))
    except (TypeError, ValueError):
        mean = std = np.full(num_channels, np.nan)
    if not (np.all(np.isfinite(mean)) and np.all(std > 0) and np.all(np.isfinite(std))):
        raise ValueError(
            "`pixel_mean` must be finite and `pixel_std` positive, one value or one per channel. Received: "
            f"pixel_mean={pixel_mean!r}, pixel_std={pixel_std!r}"
        )
    return keras.layers.Rescaling(
        [float(v) for v in 1.0 / (255.0 * std)], offset=[float(v) for v in -mean / std], name="rescaling"
    )
