"""Floating-point operations of a ViT, counted from its architecture.

`count_flops` counts the matmuls and convolutions of one image's forward
pass, a multiply-add being 2 FLOPs: the convention of the ViT paper's compute
figures and of model FLOP utilisation (MFU). Element-wise work (LayerNorm,
GELU, softmax, residual adds) is left out: it is under 1% of the total for
the standard variants and runs far below the matmul peak anyway. A training
step costs 3x the forward pass (the backward pass computes gradients with
respect to both the activations and the weights), the usual estimate.

>>> round(count_flops("B/16", image_size=224) / 1e9, 2)  # GFLOPs per image
35.13
"""

from keras_vit.resnet import ResNetStem
from keras_vit.variants import parse_variant, to_pair


def _ceil_div(n, d):
    return -(-n // d)


def _stem_flops(resnet_layers, height, width, channels):
    """FLOPs of a `ResNetStem` and the shape of its output feature map."""
    base = 64
    height, width = _ceil_div(height, 2), _ceil_div(width, 2)
    flops = 2 * height * width * 7 * 7 * channels * base  # conv_root, stride 2
    height, width, channels = _ceil_div(height, 2), _ceil_div(width, 2), base  # max pool
    for _, features, stride in ResNetStem.unit_plan(resnet_layers, base):
        out_h, out_w = _ceil_div(height, stride), _ceil_div(width, stride)
        flops += 2 * height * width * channels * features  # conv1, 1x1
        flops += 2 * out_h * out_w * 3 * 3 * features * features  # conv2, 3x3
        flops += 2 * out_h * out_w * features * 4 * features  # conv3, 1x1
        if channels != 4 * features or stride != 1:
            flops += 2 * out_h * out_w * channels * 4 * features  # conv_proj
        height, width, channels = out_h, out_w, 4 * features
    return flops, (height, width, channels)


def count_flops(
    variant,
    *,
    image_size=224,
    num_classes=1000,
    classifier="token",
    representation_size=None,
    num_channels=3,
    training=False,
    **overrides,
):
    """FLOPs of one image through `build_vit(variant, ...)` with these arguments.

    Args:
        variant, image_size, num_classes, classifier, representation_size,
            num_channels, **overrides: as for `keras_vit.build_vit`.
        training: count a training step (forward and backward, 3x the forward
            pass) instead of inference.

    Returns:
        An int: multiply-adds x 2 of the matmuls and convolutions.
    """
    config = parse_variant(variant, **overrides)
    height, width = to_pair(image_size, "image_size")
    (ph, pw), dim, mlp = config.patch_size, config.hidden_dim, config.mlp_dim
    stride = 1 if config.resnet_layers is None else ResNetStem.stride(config.resnet_layers)
    if height % (stride * ph) or width % (stride * pw):
        raise ValueError(
            f"The image size must be divisible by the patch size times the ResNet stride "
            f"({stride} * {config.patch_size}). Received: image_size={image_size!r} "
            f"(variant {variant!r})"
        )
    flops, channels = 0, num_channels
    if config.resnet_layers is not None:
        flops, (height, width, channels) = _stem_flops(config.resnet_layers, height, width, channels)
    patches = (height // ph) * (width // pw)
    tokens = patches + (classifier in ("token", "token_gap"))
    flops += 2 * patches * ph * pw * channels * dim  # patch embedding
    per_layer = (
        2 * tokens * dim * 3 * dim  # query, key, value
        + 2 * 2 * tokens * tokens * dim  # logits and the weighted sum of values, all heads
        + 2 * tokens * dim * dim  # attention output
        + 2 * 2 * tokens * dim * mlp  # MLP
    )
    flops += config.num_layers * per_layer
    if classifier == "map":
        flops += (
            2 * dim * dim  # the probe's query
            + 2 * patches * dim * 2 * dim  # keys and values of the tokens
            + 2 * 2 * patches * dim  # one query's logits and weighted sum, all heads
            + 2 * dim * dim  # attention output
            + 2 * 2 * dim * mlp  # MLP
        )
    width_in = dim
    if representation_size:
        flops += 2 * dim * representation_size
        width_in = representation_size
    if num_classes:
        flops += 2 * width_in * num_classes
    return 3 * flops if training else flops
