"""The reference form of each kernel, in `keras.ops` only.

These are the definitions: every other form in `keras_vit.kernels` computes
the same function (the tests compare them), and they are what runs wherever no
other form applies and inside `portable_ops()`.
"""

import math
import types

import keras
from keras import ops


def gelu(x):
    """GELU with the Gaussian CDF through erf: x * (1 + erf(x / sqrt(2))) / 2.

    The function of `ops.gelu(x, approximate=False)`, whose TensorFlow kernel
    uses erfc, an op ONNX lacks; erf converts to ONNX and TFLite alike.
    """
    return 0.5 * x * (1.0 + ops.erf(x * ops.cast(1.0 / math.sqrt(2.0), x.dtype)))


def gelu_tanh(x):
    """GELU's tanh approximation: x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))) / 2.

    Hendrycks & Gimpel 2016, eq. 2; the GELU of the original ViT and
    big_vision code (Flax's `nn.gelu`, whose default is `approximate=True`).
    """
    inner = ops.cast(math.sqrt(2.0 / math.pi), x.dtype) * (x + ops.cast(0.044715, x.dtype) * x * x * x)
    return 0.5 * x * (1.0 + ops.tanh(inner))


# Read-only: the kernels keep no module-level state.
ACTIVATIONS = types.MappingProxyType({None: lambda x: x, "gelu": gelu, "gelu_tanh": gelu_tanh})


def dense(x, kernel, bias, activation=None):
    """activation(x @ kernel + bias), in x's dtype: x's last axis contracted with the kernel's first.

    A kernel of more than two axes (the attention's (hidden, 3, hidden)) gives
    outputs with its trailing axes, (..., 3, hidden), without reshaping the
    kernel: a reshape would merge an axis that a device mesh may shard
    (`keras_vit.distribute`) with one it does not. Weights are cast to x's
    dtype: under a mixed policy the variables are float32 and the activations
    16-bit.
    """
    kernel = ops.cast(kernel, x.dtype)
    y = ops.matmul(x, kernel) if len(kernel.shape) == 2 else ops.tensordot(x, kernel, axes=1)
    if bias is not None:
        y = y + ops.cast(bias, x.dtype)
    return ACTIVATIONS[activation](y)


def int8_dense(x, kernel, kernel_scale, bias, dtype, inputs_quantizer):
    """x @ kernel + bias with an int8 `kernel` (its first axis contracted with x's last, its other axes those of
    the result) and its per-column `kernel_scale` (the kernel's other axes), in `dtype`: x quantized per row
    by `inputs_quantizer` and an int8 matmul, or (None: weight-only) x times the int8 values; then de-scaled.
    Keras' own int8 matmul (Jacob et al. 2018, symmetric per-channel weights)."""
    shape = tuple(kernel.shape)
    matrix, scale = ops.reshape(kernel, (shape[0], -1)), ops.reshape(kernel_scale, (-1,))
    if inputs_quantizer is None:
        y = ops.divide(ops.matmul(x, ops.cast(matrix, dtype)), scale)
    else:
        inputs, inputs_scale = inputs_quantizer(x, axis=-1)
        y = ops.divide(ops.cast(ops.matmul(inputs, matrix), dtype), ops.multiply(ops.cast(inputs_scale, dtype), scale))
    if len(shape) > 2:  # (..., n * hidden) -> (..., n, hidden), as the float kernel's result.
        y = ops.reshape(y, (*ops.shape(y)[:-1], *shape[1:]))
    return y if bias is None else ops.add(y, ops.cast(bias, dtype))


def is_default_int8_quantizer(quantizer):
    """Whether `quantizer` is Keras' default for int8 activations: abs-max onto [-127, 127] (per token when
    called with axis=-1), the quantization the fast forms may replace by their own of the same range."""
    return (
        type(quantizer) is keras.quantizers.AbsMaxQuantizer
        and tuple(quantizer.value_range) == (-127, 127)
        and quantizer.output_dtype == "int8"
    )


def layer_norm(x, gamma, beta, epsilon):
    """(x - mean) / sqrt(var + epsilon) * gamma + beta over the last axis, in x's dtype
    (computed in float32 at least, as `keras.layers.LayerNormalization` does)."""
    return ops.cast(ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon), x.dtype)


def dropout(x, rate, seed, noise_shape=None):
    """Zeroes elements with probability `rate` and scales the rest by 1 / (1 - rate)."""
    return keras.random.dropout(x, rate, noise_shape=noise_shape, seed=seed)


def dim(x, axis):
    """`x`'s size along `axis`: the static one, or (a sequence of any length: a model taking any image size,
    traced by TensorFlow) the one known when the graph runs."""
    size = x.shape[axis]
    return size if size is not None else ops.shape(x)[axis]


def qkv_width(qkv):
    """The hidden width of projected tokens, (batch, tokens, 3, hidden) or (batch, tokens, 3 * hidden)."""
    return qkv.shape[-1] if len(qkv.shape) == 4 else qkv.shape[-1] // 3


def split_heads(x, num_heads):
    """(batch, tokens, hidden) -> (batch, heads, tokens, head_dim)."""
    tokens, hidden = dim(x, 1), x.shape[-1]
    return ops.transpose(ops.reshape(x, (-1, tokens, num_heads, hidden // num_heads)), (0, 2, 1, 3))


def split_stacked_heads(projections, count, num_heads):
    """`count` projections stacked, (batch, tokens, count, hidden) (the layers' layout) or the same
    numbers as (batch, tokens, count * hidden) -> `count` tensors (batch, heads, tokens, head_dim)."""
    tokens, width = dim(projections, 1), projections.shape[-1]
    hidden = width if len(projections.shape) == 4 else width // count
    projections = ops.reshape(projections, (-1, tokens, count, num_heads, hidden // num_heads))
    # Unstacking the projections: its gradient is one stack, where indexing's is one
    # full-size zero tensor per index.
    return ops.unstack(ops.transpose(projections, (2, 0, 3, 1, 4)), count, axis=0)


def scale_query(query):
    """query / sqrt(head_dim), in query's dtype."""
    return query * ops.cast(1.0 / math.sqrt(query.shape[-1]), query.dtype)


def split_qkv(qkv, num_heads):
    """(batch, tokens, 3, hidden) or (batch, tokens, 3 * hidden) -> query / sqrt(head_dim),
    key, value, each (batch, heads, tokens, head_dim)."""
    query, key, value = split_stacked_heads(qkv, 3, num_heads)
    return scale_query(query), key, value


def merge_heads(x):
    """(batch, heads, tokens, head_dim) -> (batch, tokens, heads * head_dim)."""
    heads, tokens, head_dim = x.shape[1], dim(x, 2), x.shape[3]
    return ops.reshape(ops.transpose(x, (0, 2, 1, 3)), (-1, tokens, heads * head_dim))


def attend(query, key, value, training=False, dropout=None):
    """softmax(query key^T) value per head, each (batch, heads, tokens, head_dim) with the query
    already scaled; returns (the attended values (batch, tokens, hidden), the probabilities
    (batch, heads, query tokens, key tokens) in float32)."""
    dtype = query.dtype
    logits = ops.matmul(query, ops.swapaxes(key, -1, -2))
    # Softmax in float32: bfloat16's 8 bits of mantissa are too few to
    # normalise a row of a few hundred probabilities.
    probabilities = ops.softmax(ops.cast(logits, "float32"), axis=-1)
    weights = ops.cast(probabilities, dtype)
    if dropout is not None:
        weights = dropout(weights, training=training)
    return merge_heads(ops.matmul(weights, value)), probabilities


def attention(qkv, num_heads, training=False, dropout=None):
    """softmax(q k^T / sqrt(head_dim)) v per head (paper eq. 5-8, appendix A).

    Args:
        qkv: (batch, tokens, 3, hidden), the query, key and value projections
            with the heads inside each (or the same numbers as (batch, tokens,
            3 * hidden)).
        num_heads: heads.
        training: whether `dropout` applies.
        dropout: None, or a callable (x, training) applied to the probabilities.

    Returns:
        (attended (batch, tokens, hidden), probabilities (batch, heads, tokens,
        tokens) in float32).
    """
    return attend(*split_qkv(qkv, num_heads), training=training, dropout=dropout)


def cross_attention(query, key_value, num_heads):
    """softmax(q k^T / sqrt(head_dim)) v per head, the queries from other tokens than the keys
    and values (the MAP head's probe attending to the encoder's tokens).

    Args:
        query: (batch, query tokens, hidden), the query projections, heads inside.
        key_value: (batch, tokens, 2, hidden), the key and value projections
            stacked, heads inside each.
        num_heads: heads.

    Returns:
        The attended values, (batch, query tokens, hidden).
    """
    key, value = split_stacked_heads(key_value, 2, num_heads)
    return attend(scale_query(split_heads(query, num_heads)), key, value)[0]
