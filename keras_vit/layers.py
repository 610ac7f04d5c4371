"""The layers of a Vision Transformer, in `keras.ops` only.

Every layer is registered as serializable under the package name "keras_vit",
has a `get_config` returning exactly its constructor arguments, and creates its
weights in `build()`.

Weight layouts are chosen so that the original checkpoints map onto them by a
reshape (see `keras_vit.model` for the names):
- `PatchEncoder.kernel` is (patch_h, patch_w, channels, hidden), like the
  original `embedding/kernel`.
- `MultiHeadSelfAttention.qkv_kernel` is (hidden, 3 * hidden): the query, key
  and value kernels of shape (hidden, heads, head_dim) reshaped to
  (hidden, hidden) and concatenated in that order, so one matmul computes all
  three projections.
"""

import contextlib
import functools
import math
import threading

import keras
from keras import ops

from keras_vit.variants import to_pair

register = keras.saving.register_keras_serializable(package="keras_vit")


def _check_rate(name, value):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1). Received: {name}={value!r}")
    return float(value)


def _check_positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return value


def _check_image_shape(layer, input_shape, patch_size, channels=None):
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


def exact_gelu(x):
    """GELU with the Gaussian CDF written through erf: x * (1 + erf(x / sqrt(2))) / 2.

    The same function as `ops.gelu(x, approximate=False)`, whose TensorFlow
    kernel uses erfc, an op ONNX lacks; erf converts to ONNX and TFLite alike.
    """
    return 0.5 * x * (1.0 + ops.erf(x * ops.cast(1.0 / math.sqrt(2.0), x.dtype)))


def bias_add(x, bias):
    """`x + bias` over the last axis.

    On TensorFlow this is `tf.nn.bias_add` (a BiasAdd op): TensorFlow's
    graph optimiser fuses MatMul + BiasAdd + GELU into one oneDNN kernel, while
    MatMul + AddV2 only gets the bias fused and leaves the GELU as four
    element-wise passes over the activations. Other backends add.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.nn.bias_add(x, bias)
    return ops.add(x, bias)


_TRACING = threading.local()


@contextlib.contextmanager
def _tracing_setting(name, value):
    """Sets `name` for the layers traced on this thread within it, then restores it."""
    previous = getattr(_TRACING, name, None)
    setattr(_TRACING, name, value)
    try:
        yield
    finally:
        setattr(_TRACING, name, previous)


def portable_ops():
    """Layers called within it trace with ops that every runtime and converter knows.

    Exports (`keras_vit.export`) trace the model inside it: the oneDNN form of
    `layer_norm` is a training-mode FusedBatchNormV3 with epsilon below
    cuDNN's minimum, which TFLite and ONNX do not convert and a GPU would not
    run.
    """
    return _tracing_setting("portable", True)


def fused_attention(enabled):
    """Attention traced within it is `keras.ops.dot_product_attention` (True)
    or the explicit batched matmuls and softmax (False), on any backend,
    instead of the choice `_fused_attention_path` makes. For comparing the
    two (`python -m experiments.benchmark --mode=attention`); both compute
    the same function.
    """
    return _tracing_setting("fused_attention", bool(enabled))


def _split_attention_batch(batch):
    """Whether training-mode attention runs as two halves of the batch.

    On TensorFlow with no GPU or TPU, when the batch size is static and even
    (`drop_remainder=True`, as TPU and XLA training use). XLA's CPU runtime
    runs a batched matmul as a loop of small matmuls (197x64x197 for ViT at
    224 px) at a third of the matmul peak; two independent halves keep both
    cores busier: an XLA S/16 training step 1.02-1.04x faster (8.43 and 8.47
    against 8.08 and 8.27 images/s, batch 16, models interleaved), without XLA
    the same (7.59 and 7.55 against 7.61 and 7.50). The halves compute the
    same numbers; with attention dropout each half draws its own mask, so a
    seeded run's masks differ from those of one piece.
    """
    return batch is not None and batch >= 2 and batch % 2 == 0 and _tensorflow_cpu_path()


@functools.lru_cache(maxsize=None)
def _cpu_only():
    """No GPU or TPU that ops could be placed on."""
    from keras_vit.training import accelerator

    return accelerator() == "cpu"


@functools.lru_cache(maxsize=None)
def _onednn_enabled():
    """Whether TensorFlow was built with oneDNN."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return _pywrap_util_port.IsMklEnabled()
    except (ImportError, AttributeError):
        return False


def _tensorflow_cpu_path():
    """Whether layers traced now run as TensorFlow ops on a CPU, outside `portable_ops()`."""
    return keras.backend.backend() == "tensorflow" and not getattr(_TRACING, "portable", False) and _cpu_only()


def _float32_on_tensorflow_cpu(dtype):
    """Whether layers of compute `dtype` traced now run float32 TensorFlow ops on a CPU."""
    return dtype == "float32" and _tensorflow_cpu_path()


def _hand_written_gradients(training, dtype):
    """Whether layers traced now use `_layer_norm_for_training` and, without
    attention dropout or returned scores, `_native_attention` or
    `_attention_for_training`: float32 training on `_tensorflow_cpu_path()`."""
    return bool(training) and _float32_on_tensorflow_cpu(dtype)


def _xla_on_tensorflow_cpu():
    """Whether ops traced now are compiled by XLA on `_tensorflow_cpu_path()`:
    inside a `tf.function(jit_compile=True)`, which Keras' `jit_compile=True`
    wraps each training step in (it traces the step in an XLA context)."""
    if not _tensorflow_cpu_path():
        return False
    import tensorflow as tf

    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _onednn_path():
    """Whether layers traced now may use the oneDNN-specific forms."""
    return _tensorflow_cpu_path() and _onednn_enabled()


def _fused_attention_path():
    """Whether attention may call `keras.ops.dot_product_attention`: on a GPU or
    TPU, with a backend other than TensorFlow.

    There JAX runs cuDNN's fused (flash) attention on NVIDIA GPUs from Ampere
    on for 16-bit inputs, Splash attention on TPUs, and its own XLA
    formulation otherwise (logits and softmax in float32, as here); PyTorch
    runs `scaled_dot_product_attention`. On a CPU, JAX's XLA formulation was
    ~15% slower than the explicit form below (Ti/16, batch 8, float32 and
    bfloat16), and TensorFlow's version is the same batched matmuls as the
    explicit form, which keeps the oneDNN-tuned softmax and converts to
    TFLite as it is.
    """
    forced = getattr(_TRACING, "fused_attention", None)
    if forced is not None:
        return forced
    from keras_vit.training import accelerator

    return keras.backend.backend() != "tensorflow" and accelerator() != "cpu"


def layer_norm(x, layer, training=None):
    """`layer` (a `keras.layers.LayerNormalization` over the last axis) applied to x.

    With TensorFlow on a CPU with oneDNN, the normalisation is written as
    Reshape -> FusedBatchNormV3 (training mode, unit scale and zero offset
    from Fill ops, over rows) -> Reshape -> * gamma + beta: the subgraph
    TensorFlow's graph optimiser replaces by oneDNN's LayerNorm kernel (~4x
    faster than the six element-wise passes of the plain formula at ViT
    sizes, and in bfloat16 without the casts to float32). The row count goes
    through PlaceholderWithDefault so that constant folding keeps the Fill ops
    the pattern needs when the batch size is static. The optimiser fuses only
    inference graphs, and an XLA-compiled training step with the batch-norm
    form ran 10x slower: float32 training with TensorFlow on a CPU takes
    `_layer_norm_for_training` instead. Elsewhere, or inside `portable_ops()`,
    it calls the layer. Same numbers within float32 rounding
    (tests/test_layers.py).
    """
    standard = (
        layer.center
        and layer.scale
        and not getattr(layer, "rms_scaling", False)
        and tuple(layer.axis) in ((-1,), (len(x.shape) - 1,))
    )
    if standard and _hand_written_gradients(training, x.dtype):
        return _layer_norm_for_training(x, layer)
    if training or not standard or not _onednn_path():
        return layer(x)
    import tensorflow as tf

    width = x.shape[-1]
    rows = tf.raw_ops.PlaceholderWithDefault(input=tf.size(x) // width, shape=[])
    fill_shape = tf.reshape(rows, [1])
    empty = tf.constant([], tf.float32)
    normalised = tf.raw_ops.FusedBatchNormV3(
        x=tf.reshape(x, tf.stack([1, rows, width, 1])),
        scale=tf.fill(fill_shape, 1.0),
        offset=tf.fill(fill_shape, 0.0),
        mean=empty,
        variance=empty,
        epsilon=layer.epsilon,
        data_format="NCHW",
        is_training=True,
    ).y
    normalised = tf.reshape(normalised, tf.shape(x))
    return normalised * ops.cast(layer.gamma, x.dtype) + ops.cast(layer.beta, x.dtype)


def _layer_norm_for_training(x, layer):
    """`layer(x)` with its gradient written out, for float32 training with TensorFlow on a CPU.

    The means over the channels are matmuls with a constant column of
    1 / width, and the backward pass is the closed form
    dx = (g - mean(g) - x_hat * mean(g * x_hat)) / std with g = upstream * gamma.
    XLA's CPU compiler rewrites each reduction over more than 32 elements into
    a reduce-window (partial sums over windows of 32) followed by a reduce,
    and those reduce-windows took ~4% of an S/16 training step (80 ms of
    2.0 s, most of them the layer norms'). A matmul with a column has no
    such rewrite, and autodiff of the plain formula adds reductions the closed
    form does not need. One LayerNorm over (16, 197, 384), forward and
    backward: 2.6-2.9 ms against 4.2-4.6 with XLA, 5.1-5.7 against 7.0-7.3
    without. The same numbers within float32 rounding (tests/test_layers.py).
    """
    import tensorflow as tf

    width = x.shape[-1]
    column = tf.fill([width, 1], 1.0 / width)
    epsilon = layer.epsilon

    def channel_mean(rows):
        return tf.matmul(rows, column)

    @tf.custom_gradient
    def normalise(rows, gamma, beta):
        centred = rows - channel_mean(rows)
        inverse_std = tf.math.rsqrt(channel_mean(centred * centred) + epsilon)
        normalised = centred * inverse_std

        def gradient(upstream):
            with tf.name_scope(f"{layer.name}_gradient"):
                scaled = upstream * gamma
                rows_gradient = inverse_std * (
                    scaled - channel_mean(scaled) - normalised * channel_mean(scaled * normalised)
                )
                return rows_gradient, tf.reduce_sum(upstream * normalised, 0), tf.reduce_sum(upstream, 0)

        return normalised * gamma + beta, gradient

    with tf.name_scope(layer.name):
        gamma, beta = ops.cast(layer.gamma, x.dtype), ops.cast(layer.beta, x.dtype)
        y = tf.reshape(normalise(tf.reshape(x, (-1, width)), gamma, beta), tf.shape(x))
    y.set_shape(x.shape)
    return y


def _attention_for_training(query, key, value):
    """softmax(query @ key^T) @ value, (..., tokens, head_dim) each, with its gradient
    written out, for float32 training with TensorFlow on a CPU.

    The forward pass divides the attended values, not the (tokens, tokens)
    weights, by the softmax's sums. The backward pass uses
    rowsum(dP * P) = rowsum(d_attended * attended) (as FlashAttention does),
    a reduction over head_dim instead of over the keys, and needs no
    probabilities: autodiff of the plain form made two more passes over the
    (batch, heads, tokens, tokens) tensors, one of them a multiply that XLA
    left unfused (1.85 ms per S/16 layer and half batch, twice the fused
    subtract-multiply over the same tensor). S/16 `fit` steps with XLA: 6.59 and
    6.71 against 6.39 and 6.43 images/s (batch 16, models interleaved in one
    process); without XLA the same (6.30 and 6.35 against 6.35 and 6.36). The
    same numbers within float32 rounding (tests/test_layers.py).
    """
    import tensorflow as tf

    @tf.custom_gradient
    def attend(query, key, value):
        logits = tf.matmul(query, key, transpose_b=True)
        weights = tf.exp(logits - tf.reduce_max(logits, -1, keepdims=True))
        inverse_sum = 1.0 / tf.reduce_sum(weights, -1, keepdims=True)
        attended = tf.matmul(weights, value) * inverse_sum

        def gradient(upstream):
            with tf.name_scope("attention_gradient"):
                scaled = upstream * inverse_sum
                value_gradient = tf.matmul(weights, scaled, transpose_a=True)
                # rowsum(dP * P) = rowsum(upstream * attended): on (tokens, head_dim), not (tokens, tokens).
                offset = tf.reduce_sum(upstream * attended, -1, keepdims=True) * inverse_sum
                logits_gradient = weights * (tf.matmul(scaled, value, transpose_b=True) - offset)
                return (
                    tf.matmul(logits_gradient, key),
                    tf.matmul(logits_gradient, query, transpose_a=True),
                    value_gradient,
                )

        return attended, gradient

    return attend(query, key, value)


# The native kernels' limit (keras_vit/native/attention_ops.cc): two (tokens, tokens) float32 blocks per thread.
_NATIVE_MAX_TOKENS = 8192


# The functions Keras' TensorFlow trainer (3.x) traces for fit, evaluate and predict.
_KERAS_LOOP_FUNCTIONS = frozenset(
    {
        "one_step_on_data",
        "one_step_on_data_distributed",
        "multi_step_on_data",
        "one_step_on_iterator",
        "multi_step_on_iterator",
    }
)


def _in_keras_loop():
    """Whether ops traced now belong to one of Keras' own training, evaluation
    or prediction functions (the graph being traced or one it is nested in)."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(graph, "name", None) in _KERAS_LOOP_FUNCTIONS:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _native_attention_ops():
    """`keras_vit.native.attention_ops()`, or None inside `native_attention(False)`."""
    if getattr(_TRACING, "native_attention", None) is False:
        return None
    from keras_vit import native

    return native.attention_ops()


def native_attention(enabled):
    """Float32 attention traced within it uses the native kernels where the
    layer would (True, where they build) or the TensorFlow-op form (False).
    For comparing the two; both compute the same function."""
    return _tracing_setting("native_attention", bool(enabled))


def _native_attention(qkv, num_heads):
    """softmax(q k^T / sqrt(head_dim)) v for every head, (batch, tokens, 3 * hidden) ->
    (batch, tokens, hidden), by the native CPU kernels (`keras_vit/native/attention.h`).

    Used for float32 training with TensorFlow on a CPU without attention dropout
    or returned scores, and for float32 inference there inside Keras' loops
    (`MultiHeadSelfAttention._native_inference`). The kernels read q, k and v from the projection's output
    and write the attended values in the output projection's layout (no
    transposes), keep each (tokens, tokens) block in a thread's cache from the
    logits to the attended values, and keep only the softmax's log-normalisers
    for the backward pass, which recomputes the probabilities. XLA runs them as
    custom calls. One S/16 layer's attention, forward and backward, half a
    batch of 16: 14 ms against 20 ms for `_attention_for_training` with its
    transposes under XLA. The gradient op has no gradient of its own:
    second-order derivatives (nested tapes) need `native_attention(False)`
    or `KERAS_VIT_NATIVE=0`.
    """
    import tensorflow as tf

    library = _native_attention_ops()

    @tf.custom_gradient
    def attend(qkv):
        attended, logsumexp = library.keras_vit_attention(qkv, num_heads=num_heads)

        def gradient(upstream):
            return library.keras_vit_attention_grad(qkv, attended, logsumexp, upstream, num_heads=num_heads)

        return attended, gradient

    return attend(qkv)


def dense(x, kernel, bias, gelu=False):
    """`x @ kernel + bias` (then exact GELU) on the last axis of x, in x's dtype.

    The weights are cast to x's dtype (under a mixed policy the variables are
    float32, the activations 16-bit). The leading axes are flattened first so
    that the matmul, the bias and the GELU see a 2-D matrix: the form that
    oneDNN fuses into one kernel (see `bias_add`). The same numbers as a
    `keras.layers.Dense`.
    """
    shape = x.shape
    kernel, bias = ops.cast(kernel, x.dtype), ops.cast(bias, x.dtype)
    y = bias_add(ops.matmul(ops.reshape(x, (-1, shape[-1])), kernel), bias)
    if gelu:
        y = exact_gelu(y)
    return ops.reshape(y, (-1, *shape[1:-1], kernel.shape[-1]))


# === Layers ===


@register
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` whose masks are drawn with ThreeFry in
    XLA-compiled TensorFlow steps on a CPU.

    TensorFlow's stateless dropout draws Philox numbers by default. XLA's CPU
    backend computes Philox's 32x32->64-bit products one element at a time,
    while ThreeFry-2x32 (Salmon et al. 2011, JAX's default generator) is 32-bit
    additions, rotations and xors that vectorise: with the masks from ThreeFry
    the main job's (digits, 13 dropouts) XLA training step took 64-74 ms
    against 95 ms (medians of five and one runs, separate processes), and 96
    against 122 ms in a slower period; the masks had been about 40% of its op
    time.
    TensorFlow's CPU kernels without XLA have no ThreeFry and keep Philox;
    other backends use `keras.random.dropout`. Same distribution either way:
    each element is kept with probability 1 - rate and scaled by 1 / (1 - rate).
    """

    def call(self, inputs, training=False):
        if training and 0.0 < self.rate < 1.0 and self.noise_shape is None and _xla_on_tensorflow_cpu():
            import tensorflow as tf

            seed = self.seed_generator.next()
            if seed.dtype != tf.int32:  # The stateless ops take int32 seeds under XLA.
                seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
            return tf.nn.experimental.stateless_dropout(
                inputs, rate=self.rate, seed=seed, rng_alg="threefry"
            )
        return super().call(inputs, training=training)


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
        self.grid_size = _check_image_shape("Patches", input_shape, self.patch_size)

    def call(self, images):
        return extract_patches(images, self.patch_size, self.grid_size)

    def compute_output_shape(self, input_shape):
        gh, gw = _check_image_shape("Patches", input_shape, self.patch_size)
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
            `kernel`. "conv" is the default: under XLA, which `fit` and
            `predict` use by default, it was 1.2x faster for B/16 at 224 px on a
            2-core CPU; without XLA "matmul" was 1.1x faster
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
        self.hidden_dim = _check_positive_int("hidden_dim", hidden_dim)
        self.patch_size = to_pair(patch_size, "patch_size")
        self.use_class_token = bool(use_class_token)
        if projection not in self.PROJECTIONS:
            raise ValueError(
                f"`projection` must be one of {self.PROJECTIONS}. Received: projection={projection!r}"
            )
        self.projection = projection
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        self.grid_size = _check_image_shape("PatchEncoder", input_shape, self.patch_size)
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
        gh, gw = _check_image_shape("PatchEncoder", input_shape, self.patch_size)
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


@register
class MultiHeadSelfAttention(keras.layers.Layer):
    """Multi-head scaled dot-product self-attention (paper eq. 2, appendix A).

    The query, key and value projections are one matmul with a
    (hidden, 3 * hidden) kernel.  Softmax runs in float32 under mixed precision.
    On a GPU or TPU with a backend other than TensorFlow the attention itself
    is `keras.ops.dot_product_attention` (a fused kernel where the backend has
    one, see `_fused_attention_path`), unless scores are returned or attention
    dropout is active. In float32 training with TensorFlow on a CPU without
    attention dropout, the attention is keras_vit's native kernels
    (`_native_attention`) where they build, as is float32 inference traced by
    Keras' `predict` and `evaluate` (not graphs traced for export, see
    `_native_inference`); otherwise, in training with
    TensorFlow on a CPU, an even static batch is attended in two halves (see
    `_split_attention_batch`), and in float32 without attention dropout the
    attention has a hand-written gradient (`_attention_for_training`).

    Args:
        num_heads: number of heads; the input width must be divisible by it.
        dropout_rate: dropout on the attention probabilities.

    Call args:
        inputs: (batch, tokens, hidden).
        training: dropout on or off.
        return_attention_scores: also return the attention probabilities,
            (batch, heads, tokens, tokens).
    """

    def __init__(self, num_heads, dropout_rate=0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = _check_positive_int("num_heads", num_heads)
        self.dropout_rate = _check_rate("dropout_rate", dropout_rate)
        self.seed = seed

    def build(self, input_shape):
        hidden = input_shape[-1]
        if hidden is None or hidden % self.num_heads:
            raise ValueError(
                "The input width must be divisible by `num_heads`. Received: input_shape="
                f"{tuple(input_shape)}, num_heads={self.num_heads}"
            )
        self.head_dim = hidden // self.num_heads
        # Glorot-uniform as if q, k and v were three (hidden, hidden) kernels:
        # for a (hidden, 3 * hidden) kernel fan_avg is 2 * hidden, so scale 2
        # restores the limit sqrt(6 / (hidden + hidden)).
        self.qkv_kernel = self.add_weight(
            name="qkv_kernel",
            shape=(hidden, 3 * hidden),
            initializer=keras.initializers.VarianceScaling(2.0, "fan_avg", "uniform"),
        )
        self.qkv_bias = self.add_weight(name="qkv_bias", shape=(3 * hidden,), initializer="zeros")
        self.output_kernel = self.add_weight(
            name="output_kernel", shape=(hidden, hidden), initializer="glorot_uniform"
        )
        self.output_bias = self.add_weight(name="output_bias", shape=(hidden,), initializer="zeros")
        self.attention_dropout = Dropout(
            self.dropout_rate, seed=self.seed, name="attention_dropout"
        )

    def call(self, inputs, training=None, return_attention_scores=False):
        tokens, hidden = inputs.shape[1], inputs.shape[2]
        projected = dense(inputs, self.qkv_kernel, self.qkv_bias)
        qkv = ops.reshape(projected, (-1, tokens, 3, self.num_heads, self.head_dim))
        dropout = training and self.dropout_rate > 0
        if not (return_attention_scores or dropout) and _fused_attention_path():
            # (batch, tokens, heads, head_dim) is the layout the fused kernels take: no transposes.
            # Training asks for no flash kernel: cuDNN's has no backward pass for 197 tokens
            # (JAX 0.11: "Unsupported sequence length"); Keras would log that failure at every
            # trace and fall back to the XLA formulation, which this asks for directly.
            attended = ops.dot_product_attention(
                qkv[:, :, 0],
                qkv[:, :, 1],
                qkv[:, :, 2],
                scale=1.0 / math.sqrt(self.head_dim),
                flash_attention=False if training else None,
            )
            attended = ops.reshape(attended, (-1, tokens, hidden))
        elif (
            (
                self._hand_written_attention(training, return_attention_scores)
                or self._native_inference(training, return_attention_scores)
            )
            and tokens <= _NATIVE_MAX_TOKENS
            and _native_attention_ops() is not None
        ):
            attended = _native_attention(projected, self.num_heads)
        elif training and not return_attention_scores and _split_attention_batch(inputs.shape[0]):
            halves = [self._attend(half, training)[0] for half in ops.split(qkv, 2, axis=0)]
            attended = ops.concatenate(halves, axis=0)
        else:
            attended, probs = self._attend(qkv, training, return_attention_scores)
        outputs = dense(attended, self.output_kernel, self.output_bias)
        if return_attention_scores:
            return outputs, probs
        return outputs

    def _hand_written_attention(self, training, return_attention_scores):
        """Whether the attention traced now is `_native_attention` or `_attention_for_training`."""
        return _hand_written_gradients(training, self.compute_dtype) and not (
            return_attention_scores or self.dropout_rate
        )

    def _native_inference(self, training, return_attention_scores):
        """Whether inference traced now uses `_native_attention`: float32 on
        `_tensorflow_cpu_path()`, without returned scores, inside Keras' own
        loops (`predict`, `evaluate`, `fit`'s validation; `_in_keras_loop`).

        Graphs traced anywhere else - a `tf.function` of the caller's,
        `model.export`, `tf.saved_model.save`, TFLite conversion - keep
        TensorFlow's ops, so that what is saved from them loads and runs
        without keras_vit's library. Ti/16 `predict`, batch 16: 57.5 and 60.1
        against 51.3 and 53.1 images/s (same process, interleaved); the
        attention's op time per batch 39 ms against 67 ms for the batched
        matmuls, softmax, scaling and transposes it replaces.
        """
        return (
            not training
            and not return_attention_scores
            and _float32_on_tensorflow_cpu(self.compute_dtype)
            and _in_keras_loop()
        )

    def _attend(self, qkv, training, return_attention_scores=False):
        """(batch, tokens, 3, heads, head_dim) -> ((batch, tokens, hidden), probabilities)."""
        tokens, heads, head_dim = qkv.shape[1], qkv.shape[3], qkv.shape[4]
        dtype = self.compute_dtype
        qkv = ops.transpose(qkv, (2, 0, 3, 1, 4))  # (3, batch, heads, tokens, head_dim)
        if training:
            # The gradient of unstack is one stack; indexing's is, per index, a zero
            # tensor the size of qkv with the slice written in, then a sum of the three
            # (13% of an S/16 training step on a CPU without XLA; XLA fused either).
            query, key, value = ops.unstack(qkv, 3, axis=0)
        else:
            query, key, value = qkv[0], qkv[1], qkv[2]
        query = query * ops.cast(1.0 / math.sqrt(head_dim), dtype)
        if self._hand_written_attention(training, return_attention_scores):
            attended, probs = _attention_for_training(query, key, value), None
        else:
            logits = ops.matmul(query, ops.swapaxes(key, -1, -2))
            # Softmax in float32: bfloat16 has 8 bits of mantissa, too few for
            # normalising a row of a few hundred probabilities. oneDNN's softmax
            # computes in float32 whatever its input type, so on that path the
            # two casts around it (16% of a bfloat16 B/16 batch) are skipped: the
            # rounded probabilities are the same.
            if dtype != "float32" and not (training or return_attention_scores) and _onednn_path():
                probs = ops.softmax(logits, axis=-1)
            else:
                probs = ops.softmax(ops.cast(logits, "float32"), axis=-1)
            attended = ops.matmul(self.attention_dropout(ops.cast(probs, dtype), training=training), value)
        return ops.reshape(ops.transpose(attended, (0, 2, 1, 3)), (-1, tokens, heads * head_dim)), probs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "dropout_rate": self.dropout_rate,
            "seed": self.seed,
        }


@register
class TransformerBlock(keras.layers.Layer):
    """One pre-norm encoder block (paper eq. 2-3).

    x = x + DropPath(Dropout(MSA(LN(x))))
    x = x + DropPath(MLP(LN(x))),  MLP = Dense(mlp_dim) -> GELU (exact) ->
        Dropout -> Dense(hidden) -> Dropout

    Args:
        num_heads: attention heads.
        mlp_dim: width of the MLP's hidden layer.
        dropout_rate: dropout after the attention and in the MLP.
        attention_dropout_rate: dropout on the attention probabilities.
        stochastic_depth_rate: probability of dropping the block's residual
            branches for a whole sample in training (Huang et al. 2016).
        layer_norm_epsilon: 1e-6, as in the original implementation.

    Sublayers: `attention_norm`, `attention`, `mlp_norm`, `mlp_dense_1`,
    `mlp_dense_2`.

    >>> block = TransformerBlock(num_heads=2, mlp_dim=16)
    >>> tuple(block(keras.ops.zeros((1, 5, 8))).shape)
    (1, 5, 8)
    """

    def __init__(
        self,
        num_heads,
        mlp_dim,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        stochastic_depth_rate=0.0,
        layer_norm_epsilon=1e-6,
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = _check_positive_int("num_heads", num_heads)
        self.mlp_dim = _check_positive_int("mlp_dim", mlp_dim)
        self.dropout_rate = _check_rate("dropout_rate", dropout_rate)
        self.attention_dropout_rate = _check_rate("attention_dropout_rate", attention_dropout_rate)
        self.stochastic_depth_rate = _check_rate("stochastic_depth_rate", stochastic_depth_rate)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.seed = seed

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(
                "TransformerBlock expects tokens of shape (batch, tokens, hidden) with a static "
                f"hidden width. Received: input_shape={tuple(input_shape)}"
            )
        hidden = input_shape[-1]
        dense = dict(kernel_initializer="glorot_uniform", dtype=self.dtype_policy)
        self.attention_norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name="attention_norm"
        )
        self.attention = MultiHeadSelfAttention(
            self.num_heads,
            dropout_rate=self.attention_dropout_rate,
            seed=self.seed,
            dtype=self.dtype_policy,
            name="attention",
        )
        self.mlp_norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name="mlp_norm"
        )
        self.mlp_dense_1 = keras.layers.Dense(self.mlp_dim, name="mlp_dense_1", **dense)
        self.mlp_dense_2 = keras.layers.Dense(hidden, name="mlp_dense_2", **dense)
        self.dropout = Dropout(self.dropout_rate, seed=self.seed)
        self.seed_generator = keras.random.SeedGenerator(self.seed)
        for layer, shape in (
            (self.attention_norm, input_shape),
            (self.attention, input_shape),
            (self.mlp_norm, input_shape),
            (self.mlp_dense_1, input_shape),
            (self.mlp_dense_2, (*input_shape[:-1], self.mlp_dim)),
        ):
            layer.build(shape)

    def _drop_path(self, x, training):
        """Stochastic depth: zero the residual branch of whole samples."""
        if not training or self.stochastic_depth_rate == 0.0:
            return x
        keep = 1.0 - self.stochastic_depth_rate
        noise = keras.random.uniform((ops.shape(x)[0], 1, 1), seed=self.seed_generator)
        mask = ops.cast(noise < keep, x.dtype) / ops.cast(keep, x.dtype)
        return x * mask

    def call(self, inputs, training=None, return_attention_scores=False):
        attended = self.attention(
            layer_norm(inputs, self.attention_norm, training),
            training=training,
            return_attention_scores=return_attention_scores,
        )
        if return_attention_scores:
            attended, scores = attended
        x = inputs + self._drop_path(self.dropout(attended, training=training), training)
        # The MLP's Dense layers hold the weights; `dense` computes them in
        # the form oneDNN fuses (matmul + bias + GELU in one kernel).
        dense_1, dense_2 = self.mlp_dense_1, self.mlp_dense_2
        y = dense(layer_norm(x, self.mlp_norm, training), dense_1.kernel, dense_1.bias, gelu=True)
        y = self.dropout(y, training=training)
        y = self.dropout(dense(y, dense_2.kernel, dense_2.bias), training=training)
        outputs = x + self._drop_path(y, training)
        if return_attention_scores:
            return outputs, scores
        return outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout_rate": self.dropout_rate,
            "attention_dropout_rate": self.attention_dropout_rate,
            "stochastic_depth_rate": self.stochastic_depth_rate,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "seed": self.seed,
        }


@register
class TokenPooling(keras.layers.Layer):
    """Pools the encoder's tokens into one vector per image.

    "token": the class token (the first token); "gap": the mean of all tokens
    (models built with classifier "gap" have no class token).
    """

    METHODS = ("token", "gap")

    def __init__(self, method="token", **kwargs):
        super().__init__(**kwargs)
        if method not in self.METHODS:
            raise ValueError(f"`method` must be one of {self.METHODS}. Received: method={method!r}")
        self.method = method

    def call(self, tokens):
        if self.method == "token":
            return tokens[:, 0]
        return ops.mean(tokens, axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "method": self.method}
