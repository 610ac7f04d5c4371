"""The ResNet stem of the hybrid ViTs ("R50+B/16", "R26+S/32", "R+Ti/16", ...).

A BiT-style ResNet (Kolesnikov et al. 2020): convolutions with weight
standardisation and GroupNorm (32 groups, epsilon 1e-6) instead of
BatchNorm.  The units are bottlenecks (1x1 -> 3x3 -> 1x1, 4x expansion) with
the stride on the 3x3 conv and a 1x1 projection on the shortcut where shapes
change, as in the original ViT code (`vit_jax/models_resnet.py`).  Its output
feature map is cut into patches (1x1 for most hybrids) by the `PatchEncoder`.

Sublayer names follow the original checkpoint: `conv_root`, `gn_root`, then
`block{s}_unit{u}` with `conv1`..`conv3`, `gn1`..`gn3`, `conv_proj`,
`gn_proj`.
"""

import keras
from keras import ops

GROUPS = 32
GROUP_NORM_EPSILON = 1e-6
WEIGHT_STANDARDIZATION_EPSILON = 1e-5

register = keras.saving.register_keras_serializable(package="keras_vit")


@register
class StandardizedConv2D(keras.layers.Conv2D):
    """Conv2D whose kernel is standardised (zero mean, unit std per output filter) on each call."""

    def convolution_op(self, inputs, kernel):
        mean = ops.mean(kernel, axis=(0, 1, 2), keepdims=True)
        std = ops.std(kernel, axis=(0, 1, 2), keepdims=True)
        kernel = (kernel - mean) / (std + WEIGHT_STANDARDIZATION_EPSILON)
        return super().convolution_op(inputs, kernel)


def _conv(filters, kernel_size, strides, name, dtype):
    return StandardizedConv2D(
        filters, kernel_size, strides=strides, padding="same", use_bias=False, name=name, dtype=dtype
    )


def _group_norm(name, dtype, zero_scale=False):
    return keras.layers.GroupNormalization(
        GROUPS,
        epsilon=GROUP_NORM_EPSILON,
        gamma_initializer="zeros" if zero_scale else "ones",
        name=name,
        dtype=dtype,
    )


@register
class BottleneckUnit(keras.layers.Layer):
    """relu(shortcut(x) + GN(conv3(relu(GN(conv2(relu(GN(conv1(x))))))))).

    Args:
        features: width of the bottleneck; the output has 4x as many channels.
        strides: stride of the 3x3 conv (and of the shortcut projection).
    """

    def __init__(self, features, strides=1, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(features, int) or features < 1 or features % GROUPS:
            raise ValueError(
                f"`features` must be a positive multiple of {GROUPS} (the GroupNorm groups). "
                f"Received: features={features!r}"
            )
        self.features = features
        self.strides = int(strides)

    def build(self, input_shape):
        dtype = self.dtype_policy
        out = self.features * 4
        self.needs_projection = input_shape[-1] != out or self.strides != 1
        self.conv1 = _conv(self.features, 1, 1, "conv1", dtype)
        self.gn1 = _group_norm("gn1", dtype)
        self.conv2 = _conv(self.features, 3, self.strides, "conv2", dtype)
        self.gn2 = _group_norm("gn2", dtype)
        self.conv3 = _conv(out, 1, 1, "conv3", dtype)
        # Zero scale: each unit starts as the identity on its residual branch.
        self.gn3 = _group_norm("gn3", dtype, zero_scale=True)
        shapes = [
            (self.conv1, input_shape),
            (self.gn1, (*input_shape[:-1], self.features)),
            (self.conv2, (*input_shape[:-1], self.features)),
        ]
        strided = self.conv2.compute_output_shape((*input_shape[:-1], self.features))
        shapes += [(self.gn2, strided), (self.conv3, strided), (self.gn3, (*strided[:-1], out))]
        if self.needs_projection:
            self.conv_proj = _conv(out, 1, self.strides, "conv_proj", dtype)
            self.gn_proj = _group_norm("gn_proj", dtype)
            shapes += [(self.conv_proj, input_shape), (self.gn_proj, (*strided[:-1], out))]
        for layer, shape in shapes:
            layer.build(shape)

    def call(self, x):
        shortcut = self.gn_proj(self.conv_proj(x)) if self.needs_projection else x
        y = ops.relu(self.gn1(self.conv1(x)))
        y = ops.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return ops.relu(shortcut + y)

    def compute_output_shape(self, input_shape):
        batch, height, width, _ = input_shape
        ceil = lambda n: None if n is None else -(-n // self.strides)  # noqa: E731
        return (batch, ceil(height), ceil(width), self.features * 4)

    def get_config(self):
        return {**super().get_config(), "features": self.features, "strides": self.strides}


@register
class ResNetStem(keras.layers.Layer):
    """The ResNet part of a hybrid ViT.

    Root: standardised 7x7 conv, stride 2, GroupNorm, ReLU, 3x3 max pool,
    stride 2.  Then `len(num_layers)` stages of bottleneck units; stage s
    (1-based) has width 64 * width_factor * 2**(s - 1) and stride 1 for the
    first stage, 2 for the others.  Total stride: 4 * 2**(stages - 1)
    (4 with no stage).

    >>> stem = ResNetStem(num_layers=(1, 1))
    >>> tuple(stem(keras.ops.zeros((1, 32, 32, 3))).shape)
    (1, 4, 4, 512)
    """

    def __init__(self, num_layers=(3, 4, 9), width_factor=1, **kwargs):
        super().__init__(**kwargs)
        num_layers = tuple(num_layers)
        if not all(isinstance(n, int) and n > 0 for n in num_layers):
            raise ValueError(
                f"`num_layers` must be a tuple of positive integers. Received: num_layers={num_layers!r}"
            )
        if not isinstance(width_factor, int) or width_factor < 1:
            raise ValueError(
                f"`width_factor` must be a positive integer. Received: width_factor={width_factor!r}"
            )
        self.num_layers = num_layers
        self.width_factor = width_factor

    @staticmethod
    def unit_plan(num_layers, width):
        """(name, features, strides) of each bottleneck unit, in order."""
        for stage, size in enumerate(num_layers, start=1):
            for unit in range(1, size + 1):
                strides = 2 if stage > 1 and unit == 1 else 1
                yield f"block{stage}_unit{unit}", width * 2 ** (stage - 1), strides

    @staticmethod
    def stride(num_layers):
        """The total stride of a stem with these stages."""
        return 4 * 2 ** max(len(num_layers) - 1, 0)

    def build(self, input_shape):
        dtype = self.dtype_policy
        width = 64 * self.width_factor
        self.conv_root = _conv(width, 7, 2, "conv_root", dtype)
        self.gn_root = _group_norm("gn_root", dtype)
        self.pool = keras.layers.MaxPooling2D(3, 2, padding="same", dtype=dtype, name="pool")
        self.units = [
            BottleneckUnit(features, strides, name=name, dtype=dtype)
            for name, features, strides in ResNetStem.unit_plan(self.num_layers, width)
        ]
        self.conv_root.build(input_shape)
        shape = self.conv_root.compute_output_shape(input_shape)
        self.gn_root.build(shape)
        shape = self.pool.compute_output_shape(shape)
        for unit in self.units:
            unit.build(shape)
            shape = unit.compute_output_shape(shape)

    def call(self, images):
        x = self.pool(ops.relu(self.gn_root(self.conv_root(images))))
        for unit in self.units:
            x = unit(x)
        return x

    def compute_output_shape(self, input_shape):
        stride = self.stride(self.num_layers)
        batch, height, width, _ = input_shape
        ceil = lambda n: None if n is None else -(-n // stride)  # noqa: E731
        channels = 64 * self.width_factor * (2 ** (len(self.num_layers) - 1) * 4 if self.num_layers else 1)
        return (batch, ceil(height), ceil(width), channels)

    def get_config(self):
        return {
            **super().get_config(),
            "num_layers": self.num_layers,
            "width_factor": self.width_factor,
        }
