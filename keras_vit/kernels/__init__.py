"""The computations the layers delegate: attention, cross-attention, layer norm, dense, dropout.

Each entry point has one reference form in `keras.ops`
(`keras_vit.kernels.reference`), the definition, and fast forms for particular
places:

- `attention`:
  - JAX on an NVIDIA GPU, 16-bit: cuDNN's fused attention on the tokens padded
    to a multiple of 64, padded keys masked by length (`fused`);
  - GPU or TPU otherwise, backend other than TensorFlow:
    `keras.ops.dot_product_attention` (`fused`; on TPUs without Keras' Splash
    route);
  - TensorFlow on a CPU, training: two halves of an even batch; float32
    without dropout: the gradient written out (`tf_cpu`);
  - TensorFlow on a CPU with oneDNN, 16-bit inference: the softmax without the
    casts around it (`tf_cpu`).
- `cross_attention` (the MAP head's): on a GPU or TPU with a backend other
  than TensorFlow, `attention`'s two fused forms (`fused`).
- `layer_norm`:
  - TensorFlow on a CPU with oneDNN, inference: the subgraph oneDNN's
    LayerNorm replaces (`tf_cpu`);
  - TensorFlow on a CPU, float32 training: channel means as matmuls, the
    gradient written out (`tf_cpu`).
- `dense`, TensorFlow: 2-D MatMul + BiasAdd (+ GELU, exact or tanh), which the
  graph optimiser fuses, for kernels of any rank (`tf_ops`).
- `int8_dense` (Keras' int8 quantization), TensorFlow on a CPU with oneDNN,
  inference: oneDNN's u8 x s8 matmul (`tf_cpu`).
- `dropout`, TensorFlow on a CPU, XLA-compiled: ThreeFry masks (`tf_cpu`).

The form is chosen each time an entry point is traced, from
`policy.current()`: where those ops will run (backend, device or distribution
strategy), the dtype, whether TensorFlow runs oneDNN
(`compat.onednn_enabled()`: by default only on CPUs with AVX512-VNNI,
AVX512-BF16 or AMX), and the explicit switches `portable_ops()` (reference
forms everywhere; exports use it) and `fused_attention(enabled)`. Nothing is
remembered between traces.
"""

from keras_vit import compat
from keras_vit.kernels import policy, reference
from keras_vit.kernels.policy import cpu_serving, current, fused_attention, portable_ops

__all__ = [
    "attention",
    "cross_attention",
    "current",
    "dense",
    "dropout",
    "cpu_serving",
    "fused_attention",
    "int8_dense",
    "layer_norm",
    "portable_ops",
    "reference",
]


def attention(qkv, num_heads, *, training=False, dropout=None, return_probabilities=False):
    """Multi-head attention of projected tokens (paper appendix A, eq. 5-8).

    Args:
        qkv: (batch, tokens, 3, hidden): the query, key and value projections,
            heads inside each (the layer's layout); or the same numbers as
            (batch, tokens, 3 * hidden).
        num_heads: heads; hidden must be divisible by it.
        training: whether `dropout` applies.
        dropout: None, or a callable (x, training) for the attention
            probabilities, e.g. a `keras.layers.Dropout`.
        return_probabilities: also return the probabilities.

    Returns:
        The attended values (batch, tokens, hidden), and with
        `return_probabilities` the float32 probabilities (batch, heads,
        tokens, tokens) as a second result.
    """
    _check_qkv(qkv, num_heads)
    dropout = dropout if training else None
    target = policy.current()
    if return_probabilities:
        return reference.attention(qkv, num_heads, training, dropout)
    if target.use_fused_attention and dropout is None:
        from keras_vit.kernels import fused

        return fused.attention(qkv, num_heads, training=bool(training))
    if target.tensorflow_cpu:
        from keras_vit.kernels import tf_cpu

        if training:
            return tf_cpu.attention_for_training(qkv, num_heads, dropout)
        if target.onednn:
            return tf_cpu.attention_for_inference(qkv, num_heads)
    return reference.attention(qkv, num_heads, training, dropout)[0]


def cross_attention(query, key_value, num_heads, *, training=False):
    """Multi-head attention of query tokens to other tokens: the MAP head's probe attending to
    the encoder's tokens (big_vision's `MAPHead`, timm's `AttentionPoolLatent`).

    Args:
        query: (batch, query tokens, hidden), the query projections, heads
            inside.
        key_value: (batch, tokens, 2, hidden), the key and value projections
            stacked (the layer's layout), heads inside each.
        num_heads: heads; hidden must be divisible by it.
        training: whether the call is a training step (for the fused form's
            choice of kernel; there is no dropout).

    Returns:
        The attended values, (batch, query tokens, hidden).
    """
    _check_cross_attention(query, key_value, num_heads)
    if policy.current().use_fused_attention:
        from keras_vit.kernels import fused

        return fused.cross_attention(query, key_value, num_heads, training=bool(training))
    return reference.cross_attention(query, key_value, num_heads)


def layer_norm(x, gamma, beta, epsilon, *, training=False):
    """Layer normalisation over the last axis with scale `gamma` and offset `beta`."""
    target = policy.current()
    if target.tensorflow_cpu:
        from keras_vit.kernels import tf_cpu

        if training and x.dtype == "float32":
            return tf_cpu.layer_norm_for_training(x, gamma, beta, epsilon)
        if not training and target.onednn:
            return tf_cpu.layer_norm_for_inference(x, gamma, beta, epsilon)
    return reference.layer_norm(x, gamma, beta, epsilon)


def dense(x, kernel, bias=None, activation=None):
    """activation(x @ kernel + bias): x's last axis contracted with the kernel's first, the
    kernel's other axes (and the bias's) those of the result; activation None, "gelu" (exact) or
    "gelu_tanh" (its tanh approximation)."""
    if activation not in reference.ACTIVATIONS:
        raise ValueError(
            f"`activation` must be one of {sorted(map(str, reference.ACTIVATIONS))}. "
            f"Received: activation={activation!r}"
        )
    if policy.current().backend == "tensorflow":
        from keras_vit.kernels import tf_ops

        return tf_ops.dense(x, kernel, bias, activation)
    return reference.dense(x, kernel, bias, activation)


def int8_dense(x, kernel, kernel_scale, bias, dtype, inputs_quantizer, *, training=False):
    """x @ kernel + bias in `dtype` with an int8 `kernel` and its per-column `kernel_scale` (Keras' int8
    quantization: the float kernel is `kernel / kernel_scale`); `inputs_quantizer` quantizes x (Keras'
    abs-max per token by default; None: weight-only, x times the int8 values).

    TensorFlow on a CPU with oneDNN, inference, with Keras' default quantizer: oneDNN's u8 x s8 matmul, x
    quantized per tensor (`tf_cpu.int8_dense_for_inference`); otherwise the reference form.
    """
    target = policy.current()
    if (
        target.tensorflow_cpu
        and target.onednn
        and not training
        and reference.is_default_int8_quantizer(inputs_quantizer)
        and not compat.in_xla_context()
    ):
        from keras_vit.kernels import tf_cpu

        return tf_cpu.int8_dense_for_inference(x, kernel, kernel_scale, bias, dtype, frozen=target.cpu_serving)
    return reference.int8_dense(x, kernel, kernel_scale, bias, dtype, inputs_quantizer)


def check_patch_grid(images, patch_size, message):
    """Raises unless the height and width of NHWC `images` divide by `patch_size`: a ValueError (`message`, then
    the shape) where the sizes are known when traced, TensorFlow's InvalidArgumentError when the graph runs
    where they are not (a model taking any image size, traced by TensorFlow)."""
    height, width = images.shape[1], images.shape[2]
    if height is not None and width is not None:
        if height % patch_size[0] or width % patch_size[1]:
            raise ValueError(f"{message}. Received: images of shape {tuple(images.shape)}")
        return
    if policy.current().backend == "tensorflow":
        from keras_vit.kernels import tf_ops

        tf_ops.assert_divisible(images, patch_size, message)


def _check_qkv(qkv, num_heads):
    shape = tuple(qkv.shape)
    stacked = len(shape) == 4 and shape[2] == 3
    flat = len(shape) == 3 and shape[2] is not None and shape[2] % 3 == 0
    if not (stacked or flat):
        raise ValueError(
            "`qkv` must have shape (batch, tokens, 3, hidden) or (batch, tokens, 3 * hidden). "
            f"Received: qkv.shape={shape}"
        )
    hidden = reference.qkv_width(qkv)
    if hidden is None or hidden % num_heads:
        raise ValueError(
            f"The hidden width of `qkv` must be divisible by `num_heads`. Received: qkv.shape={shape} "
            f"(hidden {hidden}), num_heads={num_heads}"
        )


def _check_cross_attention(query, key_value, num_heads):
    query_shape, key_value_shape = tuple(query.shape), tuple(key_value.shape)
    hidden = query_shape[-1]
    if (
        len(query_shape) != 3
        or len(key_value_shape) != 4
        or key_value_shape[2] != 2
        or key_value_shape[-1] != hidden
        or hidden is None
    ):
        raise ValueError(
            "`query` must have shape (batch, query tokens, hidden) and `key_value` (batch, tokens, 2, hidden). "
            f"Received: query.shape={query_shape}, key_value.shape={key_value_shape}"
        )
    if hidden % num_heads:
        raise ValueError(
            f"The hidden width must be divisible by `num_heads`. Received: query.shape={query_shape}, "
            f"num_heads={num_heads}"
        )


def dropout(x, rate, seed_generator, noise_shape=None):
    """Training-mode dropout: elements kept with probability 1 - rate, scaled by 1 / (1 - rate)."""
    if policy.current().tensorflow_cpu and noise_shape is None and 0.0 < rate < 1.0 and compat.in_xla_context():
        from keras_vit.kernels import tf_cpu

        return tf_cpu.dropout_in_xla(x, rate, seed_generator)
    return reference.dropout(x, rate, seed_generator, noise_shape)
