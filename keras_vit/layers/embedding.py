"""Patches and the patch embedding: the model's input side (paper eq. 1).

Weight layout: `PatchEncoder.kernel` is (patch_h, patch_w, channels, hidden),
like the original checkpoints' `embedding/kernel`.
"""

import keras
from keras import ops

from keras_vit.layers.common import check_positive_int, register
from keras_vit.variants import to_pair


def check_image_shape(layer, input_shape, patch_size, channels=None):
    """Validates an NHWC input shape against the patch size (and channels)."""
    if len(input_shape) != 4:
        raise ValueError(
            f"{layer} expects a batch of images of shape (batch, height, width, channels). "
            f"Received: input_shape={tuple(input_shape)}"
        )
    height, width, found_channels = input_shape[1], input_shape[2], input_shape[3]
    if height is None or width is None or found_channels is None:
        raise ValueError(
            f"{layer} needs a static image height, width and channel count. "
            f"Received: input_shape={tuple(input_shape)}"
        )
    if height % patch_size[0] or width % patch_size[1]:
        raise ValueError(
            f"The image size must be divisible by the patch size. Received: image size "
            f"(height, width)=({height}, {width}), patch_size={patch_size}"
        )
    if channels is not None and found_channels != channels:
        raise ValueError(
            f"{layer} expects images with {channels} channels. Received: input_shape="
            f"{tuple(input_shape)} ({found_channels} channels)"
        )
    return height // patch_size[0], width // patch_size[1]


def extract_patches(images, patch_size, grid_size):
    """(batch, H, W, C) -> (batch, grid_h * grid_w, patch_h * patch_w * C)."""
    (ph, pw), (gh, gw), channels = patch_size, grid_size, images.shape[-1]
    x = ops.reshape(images, (-1, gh, ph, gw, pw, channels))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (-1, gh * gw, ph * pw * channels))


@register
class Patches(keras.layers.Layer):
    """Splits NHWC images into flattened, non-overlapping patches.

    The output is (batch, num_patches, patch_h * patch_w * channels), patches
    in row-major order over the grid and each patch flattened as
    (row, column, channel): the order of a conv kernel (patch_h, patch_w,
    channels, out) flattened, so `Patches` followed by a matmul with the
    reshaped kernel is the same map as a strided conv.

    >>> images = keras.ops.zeros((2, 32, 48, 3))
    >>> tuple(Patches(16)(images).shape)
    (2, 6, 768)
    """

    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = to_pair(patch_size, "patch_size")

    def build(self, input_shape):
        self.grid_size = check_image_shape("Patches", input_shape, self.patch_size)

    def call(self, images):
        return extract_patches(images, self.patch_size, self.grid_size)

    def compute_output_shape(self, input_shape):
        gh, gw = check_image_shape("Patches", input_shape, self.patch_size)
        ph, pw = self.patch_size
        return (input_shape[0], gh * gw, ph * pw * input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "patch_size": self.patch_size}


@register
class PatchEncoder(keras.layers.Layer):
    """Patch embedding, class token and position embeddings (paper eq. 1).

    Projects each PxP patch linearly to `hidden_dim`, prepends a learnable
    class token (zeros at init) when `use_class_token`, and adds learnable
    position embeddings (N(0, 0.02) at init).

    Args:
        hidden_dim: D, the width of the tokens.
        patch_size: int or (height, width).
        use_class_token: prepend the class token (classifier "token").
        projection: "conv" (a conv with kernel = stride = patch) or "matmul"
            (`Patches` then one matmul). They are the same linear map on the same
            `kernel`; which is faster depends on the platform and on XLA
            (`python -m experiments.benchmark --mode=patch_projection`).
        kernel_initializer: initializer of the projection kernel.

    Weights: `kernel` (patch_h, patch_w, channels, hidden_dim), `bias`
    (hidden_dim,), `class_token` (1, 1, hidden_dim), `position_embedding`
    (1, tokens, hidden_dim).

    >>> encoder = PatchEncoder(hidden_dim=8, patch_size=4)
    >>> tuple(encoder(keras.ops.zeros((2, 8, 12, 3))).shape)
    (2, 7, 8)
    """

    PROJECTIONS = ("conv", "matmul")

    def __init__(
        self,
        hidden_dim,
        patch_size,
        use_class_token=True,
        projection="conv",
        kernel_initializer="lecun_normal",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.hidden_dim = check_positive_int("hidden_dim", hidden_dim)
        self.patch_size = to_pair(patch_size, "patch_size")
        self.use_class_token = bool(use_class_token)
        if projection not in self.PROJECTIONS:
            raise ValueError(
                f"`projection` must be one of {self.PROJECTIONS}. Received: projection={projection!r}"
            )
        self.projection = projection
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        self.grid_size = check_image_shape("PatchEncoder", input_shape, self.patch_size)
        channels = input_shape[-1]
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(*self.patch_size, channels, self.hidden_dim),
            initializer=self.kernel_initializer,
        )
        self.bias = self.add_weight(name="bias", shape=(self.hidden_dim,), initializer="zeros")
        if self.use_class_token:
            self.class_token = self.add_weight(
                name="class_token", shape=(1, 1, self.hidden_dim), initializer="zeros"
            )
        self.position_embedding = self.add_weight(
            name="position_embedding",
            shape=(1, self.num_patches + self.use_class_token, self.hidden_dim),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
        )

    def call(self, images):
        expected = (*(g * p for g, p in zip(self.grid_size, self.patch_size)), self.kernel.shape[2])
        if tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"PatchEncoder {self.name!r} expects images of shape (batch, {expected[0]}, "
                f"{expected[1]}, {expected[2]}) (height, width, channels). Received: images "
                f"of shape {tuple(images.shape)}"
            )
        # Weights are cast explicitly: under a mixed policy the variables are
        # float32 while the tokens are bfloat16/float16.
        kernel = ops.cast(self.kernel, self.compute_dtype)
        if self.projection == "conv":
            x = ops.conv(images, kernel, strides=self.patch_size, padding="valid")
            x = ops.reshape(x, (-1, self.num_patches, self.hidden_dim))
        else:
            x = extract_patches(images, self.patch_size, self.grid_size)
            x = ops.matmul(x, ops.reshape(kernel, (-1, self.hidden_dim)))
        x = x + ops.cast(self.bias, self.compute_dtype)
        if self.use_class_token:
            class_token = ops.cast(self.class_token, self.compute_dtype)
            class_token = ops.broadcast_to(class_token, (ops.shape(x)[0], 1, self.hidden_dim))
            x = ops.concatenate([class_token, x], axis=1)
        return x + ops.cast(self.position_embedding, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        gh, gw = check_image_shape("PatchEncoder", input_shape, self.patch_size)
        return (input_shape[0], gh * gw + self.use_class_token, self.hidden_dim)

    def get_config(self):
        return {
            **super().get_config(),
            "hidden_dim": self.hidden_dim,
            "patch_size": self.patch_size,
            "use_class_token": self.use_class_token,
            "projection": self.projection,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        }
