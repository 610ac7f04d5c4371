"""Patches and the patch embedding: the model's input side (paper eq. 1).

Weight layout: `PatchEncoder.kernel` is (patch_h, patch_w, channels, hidden),
like the original checkpoints' `embedding/kernel`.
"""

import keras
import numpy as np
from keras import ops

from keras_vit import kernels
from keras_vit.layers.common import check_positive_int, register
from keras_vit.layers.core import check_norm, make_norm
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


def sincos_position_embedding_in_graph(grid_h, grid_w, hidden_dim, temperature=10_000.0):
    """`sincos_position_embedding` computed with Keras ops for a grid known only when the graph runs."""
    quarter = hidden_dim // 4
    omega = 1.0 / temperature ** (np.arange(quarter, dtype="float64") / (quarter - 1))
    omega = ops.convert_to_tensor(omega.astype("float32"))
    y, x = ops.meshgrid(ops.arange(grid_h), ops.arange(grid_w), indexing="ij")
    x = ops.reshape(ops.cast(x, "float32"), (-1, 1)) * omega
    y = ops.reshape(ops.cast(y, "float32"), (-1, 1)) * omega
    return ops.concatenate([ops.sin(x), ops.cos(x), ops.sin(y), ops.cos(y)], axis=1)


def antialiased_bicubic_weights(old, new):
    """(new, old) float32 matrix of PyTorch's bicubic resize with antialias=True (timm's
    `resample_abs_pos_embed`) for a `new` size known only when the graph runs: Keys' kernel
    (a = -0.5) stretched by old / new when shrinking, centres at (i + 0.5) old / new, taps
    outside the input left out, rows normalised.  The NumPy form, and its derivation, is
    `keras_vit.checkpoints.resample.interpolation_matrix(old, new, "bicubic_antialias")`; at
    new == old it is the identity."""
    scale = float(old) / ops.cast(new, "float32")
    stretch = ops.maximum(scale, 1.0)
    outputs = ops.cast(ops.arange(new), "float32")[:, None]
    inputs = ops.cast(ops.arange(old), "float32")[None, :]
    t = ops.abs((inputs + 0.5 - scale * (outputs + 0.5)) / stretch)
    a = -0.5
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    weights = ops.where(t <= 1, near, ops.where(t < 2, far, 0.0))
    return weights / ops.sum(weights, axis=1, keepdims=True)


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
        distillation_token: a second learned token after the class token,
            with its own position embedding (DeiT's, Touvron et al. 2021,
            "Training data-efficient image transformers & distillation
            through attention", section 5), read by a head of its own.
        patch_norm: None, or a norm of the patches' embeddings before the
            tokens and positions are added ("layer" or "rms": timm's
            `patch_embed.norm`, AIMv2's RMSNorm), with `norm_epsilon`.
        num_registers: register tokens (Darcet et al. 2023, "Vision
            Transformers Need Registers"): learned tokens inserted after the
            class token, with no position embedding, that the blocks attend
            to and the head does not read.  0: none.
        base_image_size: (height, width) or None.  Set, the layer takes
            images of any size whose sides divide by the patch size (timm's
            `dynamic_img_size`): its weights are made for this size's patch
            grid and learned position embeddings are resampled to each
            input's grid in the graph (`antialiased_bicubic_weights`, timm's
            resize), fixed ones computed for it.  None: only images of the
            size the layer is built for.

    Weights: `kernel` (patch_h, patch_w, channels, hidden_dim), `bias`
    (hidden_dim,), `class_token` (1, 1, hidden_dim), `position_embedding`
    (1, tokens, hidden_dim) if learned (a row for the class token, one for the
    distillation token, and one for each patch), `distillation_token`
    (1, 1, hidden_dim), `register_tokens` (1, num_registers, hidden_dim) with
    registers. With "sincos2d" the attribute
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
        base_image_size=None,
        num_registers=0,
        distillation_token=False,
        patch_norm=None,
        norm_epsilon=1e-6,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.patch_norm = None if patch_norm is None else check_norm(patch_norm)
        self.norm_epsilon = float(norm_epsilon)
        if not isinstance(distillation_token, bool):
            raise ValueError(f"`distillation_token` must be True or False. Received: {distillation_token!r}")
        self.distillation_token = distillation_token
        self.hidden_dim = check_positive_int("hidden_dim", hidden_dim)
        if isinstance(num_registers, bool) or not isinstance(num_registers, int) or num_registers < 0:
            raise ValueError(f"`num_registers` must be an integer >= 0. Received: num_registers={num_registers!r}")
        self.num_registers = num_registers
        self.base_image_size = None if base_image_size is None else to_pair(base_image_size, "base_image_size")
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
        if self.base_image_size is not None:
            input_shape = (input_shape[0], *self.base_image_size, input_shape[-1])
        self.grid_size = check_image_shape("PatchEncoder", input_shape, self.patch_size)
        channels = input_shape[-1]
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(*self.patch_size, channels, self.hidden_dim),
            initializer=self.kernel_initializer,
        )
        self.bias = self.add_weight(name="bias", shape=(self.hidden_dim,), initializer="zeros")
        self.norm = None
        if self.patch_norm is not None:
            self.norm = make_norm(self.patch_norm, self.norm_epsilon, dtype=self.dtype_policy, name="norm")
            self.norm.build((input_shape[0], None, self.hidden_dim))
        if self.use_class_token:
            self.class_token = self.add_weight(
                name="class_token", shape=(1, 1, self.hidden_dim), initializer="zeros"
            )
        if self.distillation_token:
            self.distillation_token_weight = self.add_weight(
                name="distillation_token", shape=(1, 1, self.hidden_dim),
                initializer=keras.initializers.TruncatedNormal(stddev=0.02),
            )
        if self.num_registers:
            # timm's initialisation of its reg_token: registers must differ from each other to learn apart.
            self.register_tokens = self.add_weight(
                name="register_tokens", shape=(1, self.num_registers, self.hidden_dim),
                initializer=keras.initializers.RandomNormal(stddev=1e-6),
            )
        tokens = self.num_patches + self.num_positioned_prefix
        if self.position_embedding_type == "learned":
            self.position_embedding = self.add_weight(
                name="position_embedding",
                shape=(1, tokens, self.hidden_dim),
                initializer=keras.initializers.RandomNormal(stddev=0.02),
            )
        else:
            fixed = sincos_position_embedding(self.grid_size, self.hidden_dim)
            self.position_embedding = np.pad(fixed, ((self.num_positioned_prefix, 0), (0, 0)))[None]

    def call(self, images):
        if self.base_image_size is None:
            expected = (*(g * p for g, p in zip(self.grid_size, self.patch_size)), self.kernel.shape[2])
            if tuple(images.shape[1:]) != expected:
                raise ValueError(
                    f"PatchEncoder {self.name!r} expects images of shape (batch, {expected[0]}, "
                    f"{expected[1]}, {expected[2]}) (height, width, channels). Received: images "
                    f"of shape {tuple(images.shape)}"
                )
            grid, positions = self.grid_size, self.position_embedding
        else:
            grid = self._input_grid(images)
            positions = self._positions(*grid)
        # Weights are cast explicitly: under a mixed policy the variables are
        # float32 while the tokens are bfloat16/float16.
        kernel = ops.cast(self.kernel, self.compute_dtype)
        if self.projection == "conv":
            x = ops.conv(images, kernel, strides=self.patch_size, padding="valid")
            x = ops.reshape(x, (-1, grid[0] * grid[1], self.hidden_dim))
        else:
            x = extract_patches(images, self.patch_size, grid)
            x = ops.matmul(x, ops.reshape(kernel, (-1, self.hidden_dim)))
        x = x + ops.cast(self.bias, self.compute_dtype)
        if self.norm is not None:
            x = self.norm(x)
        prefix = [self.class_token] if self.use_class_token else []
        prefix += [self.distillation_token_weight] if self.distillation_token else []
        if prefix:
            prefix = [ops.broadcast_to(ops.cast(t, self.compute_dtype), (ops.shape(x)[0], 1, self.hidden_dim))
                      for t in prefix]  # fmt: skip
            x = ops.concatenate([*prefix, x], axis=1)
        x = x + ops.cast(positions, self.compute_dtype)
        if self.num_registers:
            registers = ops.cast(self.register_tokens, self.compute_dtype)
            registers = ops.broadcast_to(registers, (ops.shape(x)[0], self.num_registers, self.hidden_dim))
            first = self.num_positioned_prefix
            x = ops.concatenate([x[:, :first], registers, x[:, first:]], axis=1)
        return x

    def _input_grid(self, images):
        """The patch grid of images of any size (with `base_image_size`), checked: read from their shape."""
        channels = self.kernel.shape[2]
        if images.shape[-1] != channels:
            raise ValueError(
                f"PatchEncoder {self.name!r} expects images with {channels} channels. Received: images of shape "
                f"{tuple(images.shape)}"
            )
        kernels.check_patch_grid(
            images,
            self.patch_size,
            f"PatchEncoder {self.name!r} takes images whose height and width divide by the patch size "
            f"{self.patch_size}",
        )
        shape = ops.shape(images)
        return shape[1] // self.patch_size[0], shape[2] // self.patch_size[1]

    def _positions(self, grid_h, grid_w):
        """(1, tokens, hidden_dim) float32 position embeddings for a patch grid known when the graph runs:
        learned ones resampled from the built grid (timm's resize), fixed ones computed for it."""
        prefix = self.num_positioned_prefix
        if self.position_embedding_type == "learned":
            old_h, old_w = self.grid_size
            grid = ops.reshape(ops.cast(self.position_embedding[0, prefix:], "float32"), (old_h, old_w, -1))
            rows = antialiased_bicubic_weights(old_h, grid_h)
            cols = antialiased_bicubic_weights(old_w, grid_w)
            grid = ops.einsum("ij,jkd,lk->ild", rows, grid, cols)
            patches = ops.reshape(grid, (1, grid_h * grid_w, self.hidden_dim))
            first = ops.cast(self.position_embedding[:, :prefix], "float32")
        else:
            patches = sincos_position_embedding_in_graph(grid_h, grid_w, self.hidden_dim)[None]
            first = ops.zeros((1, prefix, self.hidden_dim), "float32")
        return ops.concatenate([first, patches], axis=1) if prefix else patches

    def compute_output_shape(self, input_shape):
        if self.base_image_size is not None:
            height, width = input_shape[1], input_shape[2]
            tokens = None
            if height is not None and width is not None:
                tokens = (height // self.patch_size[0]) * (width // self.patch_size[1]) + self.num_prefix_tokens
            return (input_shape[0], tokens, self.hidden_dim)
        gh, gw = check_image_shape("PatchEncoder", input_shape, self.patch_size)
        return (input_shape[0], gh * gw + self.num_prefix_tokens, self.hidden_dim)

    @property
    def num_positioned_prefix(self):
        """The tokens before the patches that have position embeddings: the class and distillation tokens."""
        return int(self.use_class_token) + int(self.distillation_token)

    @property
    def num_prefix_tokens(self):
        """The tokens before the patches': the class token, the distillation token, then the registers."""
        return self.num_positioned_prefix + self.num_registers

    def get_config(self):
        return {
            **super().get_config(),
            "hidden_dim": self.hidden_dim,
            "patch_size": self.patch_size,
            "use_class_token": self.use_class_token,
            "projection": self.projection,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "position_embedding": self.position_embedding_type,
            "base_image_size": self.base_image_size,
            "num_registers": self.num_registers,
            "distillation_token": self.distillation_token,
            "patch_norm": self.patch_norm,
            "norm_epsilon": self.norm_epsilon,
        }
