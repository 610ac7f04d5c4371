"""A small ResNet, the convolutional baseline the paper-scale experiments compare the ViT with.

Plain Keras layers in a functional model, so it saves and reloads as any
`.keras` model.  It takes the same input as `build_vit`: raw pixels in
[0, 255], rescaled inside the model to [-1, 1] by a layer named `rescaling`.

    >>> model = build_resnet(16, 10, widths=(8, 16))
    >>> model.output_shape
    (None, 10)

The layout is He et al.'s CIFAR ResNet ("Deep Residual Learning for Image
Recognition", 2016, section 4.2): a 3x3 convolution, then stages of basic
blocks (two 3x3 convolutions with batch normalisation and an identity
shortcut, a 1x1 projection where the shape changes), each stage after the
first halving the resolution, then global average pooling and the head.  The
paper's own baseline is BiT (a ResNet with group normalisation and weight
standardisation, at ImageNet scale); batch normalisation is the usual choice
for a small CNN trained from scratch.
"""

import keras

from keras_vit.variants import to_pair


def _conv_norm(x, filters, kernel_size, strides, name):
    x = keras.layers.Conv2D(
        filters, kernel_size, strides=strides, padding="same", use_bias=False, name=f"{name}_conv"
    )(x)
    # Moving statistics with momentum 0.9 (PyTorch's default): Keras' 0.99 leaves them near their initial
    # values after the few hundred steps of a short run, and the model is evaluated with them.
    return keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_bn")(x)


def _basic_block(x, filters, strides, name):
    """Two 3x3 convolutions and a shortcut (He et al., Figure 2), ReLU after the sum."""
    y = keras.layers.ReLU(name=f"{name}_relu1")(_conv_norm(x, filters, 3, strides, f"{name}_1"))
    y = _conv_norm(y, filters, 3, 1, f"{name}_2")
    if strides != 1 or x.shape[-1] != filters:
        x = _conv_norm(x, filters, 1, strides, f"{name}_proj")
    return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([x, y]))


def build_resnet(image_size, num_classes, *, widths=(24, 48, 96), blocks_per_stage=1, channels=3, name="resnet"):
    """A ResNet of `len(widths)` stages of `blocks_per_stage` basic blocks.

    Args:
        image_size: int or (height, width) of the input.
        num_classes: the head's outputs (float32 logits).
        widths: the channels of each stage; each stage after the first
            halves the resolution.
        blocks_per_stage: basic blocks per stage.
        channels: input channels.
        name: the model's name.
    """
    height, width = to_pair(image_size, "image_size")
    widths = tuple(widths)
    if not widths or not all(isinstance(w, int) and w > 0 for w in widths):
        raise ValueError(f"`widths` must be positive integers, one per stage. Received: widths={widths!r}")
    if not isinstance(blocks_per_stage, int) or blocks_per_stage < 1:
        raise ValueError(
            f"`blocks_per_stage` must be a positive integer. Received: blocks_per_stage={blocks_per_stage!r}"
        )
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"`num_classes` must be a positive integer. Received: num_classes={num_classes!r}")

    inputs = keras.Input((height, width, channels), name="image")
    x = keras.layers.Rescaling(1.0 / 127.5, offset=-1.0, name="rescaling")(inputs)
    x = keras.layers.ReLU(name="stem_relu")(_conv_norm(x, widths[0], 3, 1, "stem"))
    for stage, filters in enumerate(widths):
        for block in range(blocks_per_stage):
            strides = 2 if stage > 0 and block == 0 else 1
            x = _basic_block(x, filters, strides, f"stage{stage}_block{block}")
    x = keras.layers.GlobalAveragePooling2D(name="pooling")(x)
    outputs = keras.layers.Dense(num_classes, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs, name=name)
