"""Patches and the patch embedding: the model's input side (paper eq. 1).

Weight layout: `PatchEncoder.kernel` is (patch_h, patch_w, channels, hidden),
like the original checkpoints' `embedding/kernel`.
"""

import keras
import numpy as np
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


def sincos_position_embedding(grid_size, hidden_dim, temperature=10_000.0):
    """Fixed 2-D sin-cos position embeddings, (grid_h * grid_w, hidden_dim) float32.

    The form of big_vision's `posemb_sincos_2d` (after MoCo v3; used by "Better
    plain ViT baselines", Beyer et al. 2022): with y, x the row and column of a
    patch and omega_i = temperature^(-i / (hidden_dim / 4 - 1)) for i = 0 ..
    hidden_dim / 4 - 1, a patch's embedding is [sin(x omega), cos(x omega),
    sin(y omega), cos(y omega)]. Rows in row-major order over the grid, as the
    patches.

    >>> embeddings = sincos_position_embedding((2, 3), 8)
    >>> embeddings.shape
    (6, 8)
    >>> embeddings[0].tolist()  # row 0, column 0: sin 0 and cos 0
    [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    """
    check_sincos_width(hidden_dim)
    y, x = np.meshgrid(np.arange(grid_size[0]), np.arange(grid_size[1]), indexing="ij")
    quarter = hidden_dim // 4
    omega = 1.0 / temperature ** (np.arange(quarter) / (quarter - 1))
    x = x.reshape(-1, 1) * omega
    y = y.reshape(-1, 1) * omega
    return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1).astype("float32")


def check_sincos_width(hidden_dim):
    """A ValueError unless 2-D sin-cos embeddings exist for this width: a multiple of 4, at least 8."""
    if hidden_dim % 4 or hidden_dim < 8:
        raise ValueError(
            "Fixed 2-D sin-cos position embeddings need a hidden width that is a multiple of 4 and at "
            "least 8 (a quarter per sin/cos of the row/column, with two or more frequencies each). "
            f"Received: hidden_dim={hidden_dim}"
        )


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
    class token (zeros at init) when `use_class_token`, and adds position
    embeddings: learnable ones (N(0, 0.02) at init), or fixed 2-D sin-cos ones
    computed from the patch grid (`sincos_position_embedding`; the class
    token then gets none, as in big_vision). Fixed ones are no weight: at
    another image size they are computed for the new grid, not resampled.

    Args:
        hidden_dim: D, the width of the tokens.
        patch_size: int or (height, width).
        use_class_token: prepend the class token (classifier "token").
        projection: "conv" (a conv with kernel = stride = patch) or "matmul"
            (`Patches` then one matmul). They are the same linear map on the same
            `kernel`; which is faster depends on the platform and on XLA
            (`python -m experiments.benchmark --mode=patch_projection`).
        kernel_initializer: initializer of the projection kernel.
        position_embedding: "learned" or "sincos2d" (fixed; hidden_dim a
            multiple of 4, at least 8).

    Weights: `kernel` (patch_h, patch_w, channels, hidden_dim), `bias`
    (hidden_dim,), `class_token` (1, 1, hidden_dim), `position_embedding`
    (1, tokens, hidden_dim) if learned. With "sincos2d" the attribute
    `position_embedding` is the fixed (1, tokens, hidden_dim) NumPy array
    (a zero row for the class token) instead.

    >>> encoder = PatchEncoder(hidden_dim=8, patch_size=4)
    >>> tuple(encoder(keras.ops.zeros((2, 8, 12, 3))).shape)
    (2, 7, 8)
    """

    PROJECTIONS = ("conv", "matmul")
    POSITION_EMBEDDINGS = ("learned", "sincos2d")

    def __init__(
        self,
        hidden_dim,
        patch_size,
        use_class_token=True,
        projection="conv",
        kernel_initializer="lecun_normal",
        position_embedding="learned",
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
        if position_embedding not in self.POSITION_EMBEDDINGS:
            raise ValueError(
                f"`position_embedding` must be one of {self.POSITION_EMBEDDINGS}. Received: "
                f"position_embedding={position_embedding!r}"
            )
        if position_embedding == "sincos2d":
            check_sincos_width(self.hidden_dim)
        # The attribute `position_embedding` holds the embeddings themselves (built).
        self.position_embedding_type = position_embedding

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
        tokens = self.num_patches + self.use_class_token
        if self.position_embedding_type == "learned":
            self.position_embedding = self.add_weight(
                name="position_embedding",
                shape=(1, tokens, self.hidden_dim),
                initializer=keras.initializers.RandomNormal(stddev=0.02),
            )
        else:
            fixed = sincos_position_embedding(self.grid_size, self.hidden_dim)
            self.position_embedding = np.pad(fixed, ((int(self.use_class_token), 0), (0, 0)))[None]

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
            "position_embedding": self.position_embedding_type,
        }
