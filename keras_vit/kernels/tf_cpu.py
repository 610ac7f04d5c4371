"""TensorFlow forms for a CPU: graph forms oneDNN fuses, gradients written out,
attention in two halves of the batch, ThreeFry dropout masks under XLA.

Each computes the function of its reference form (`keras_vit.kernels.reference`)
within float32 rounding (tests/test_kernels_*.py). `keras_vit.kernels` picks them
for ops traced for a CPU with TensorFlow, outside `portable_ops()`.
"""

import numpy as np
import tensorflow as tf
from keras import ops

from keras_vit.kernels import reference, tf_ops


def layer_norm_for_inference(x, gamma, beta, epsilon):
    """The reference `layer_norm` as the subgraph TensorFlow's optimiser replaces by
    oneDNN's LayerNorm kernel, where TensorFlow is built with oneDNN.

    Reshape -> FusedBatchNormV3 (training mode, unit scale and zero offset from
    Fill ops, over rows) -> Reshape -> * gamma + beta. It replaces the six
    element-wise passes of the plain formula, and in bfloat16 the casts to
    float32. The row count goes through PlaceholderWithDefault so that constant
    folding keeps the Fill ops the pattern needs when the batch size is static.
    The optimiser fuses inference graphs only; converters (TFLite, ONNX) and
    GPUs refuse this form (an epsilon below cuDNN's minimum), which is why
    exports trace inside `portable_ops()`.

    The result leaves through a Snapshot: without it, an add that follows (a
    model without a class token adds the position embeddings to its patch norm's
    output) is merged with `+ beta` by the arithmetic optimiser, whose sum the
    layer norm fusion then takes as its offset, and the graph fails with "offset
    must be 1D" (TensorFlow 2.20 and 2.21). A Snapshot with one consumer hands
    its buffer on without a copy.
    """
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
        epsilon=epsilon,
        data_format="NCHW",
        is_training=True,
    ).y
    normalised = tf.reshape(normalised, tf.shape(x))
    return _snapshot(normalised * ops.cast(gamma, x.dtype) + ops.cast(beta, x.dtype))


@tf.custom_gradient
def _snapshot(x):
    """x through a Snapshot op (see `layer_norm_for_inference`), whose gradient is the identity's (TensorFlow
    registers none for Snapshot: a frozen layer's norm is traced in this form and still passes gradients)."""
    return tf.raw_ops.Snapshot(input=x), lambda upstream: upstream


def layer_norm_for_training(x, gamma, beta, epsilon):
    """The reference float32 `layer_norm` with its gradient written out.

    The means over the channels are matmuls with a constant column of
    1 / width, and the backward pass is the closed form
    dx = (g - mean(g) - x_hat * mean(g * x_hat)) / std with g = upstream * gamma.
    XLA's CPU compiler rewrites each reduction over more than 32 elements into
    a reduce-window followed by a reduce; a matmul with a column has no such
    rewrite, and autodiff of the plain formula adds reductions the closed form
    does not need.
    """
    width = x.shape[-1]
    column = tf.fill([width, 1], 1.0 / width)

    def channel_mean(rows):
        return tf.matmul(rows, column)

    @tf.custom_gradient
    def normalise(rows, gamma, beta):
        centred = rows - channel_mean(rows)
        inverse_std = tf.math.rsqrt(channel_mean(centred * centred) + epsilon)
        normalised = centred * inverse_std

        def gradient(upstream):
            with tf.name_scope("layer_norm_gradient"):
                scaled = upstream * gamma
                rows_gradient = inverse_std * (
                    scaled - channel_mean(scaled) - normalised * channel_mean(scaled * normalised)
                )
                return rows_gradient, tf.reduce_sum(upstream * normalised, 0), tf.reduce_sum(upstream, 0)

        return normalised * gamma + beta, gradient

    with tf.name_scope("layer_norm"):
        gamma, beta = ops.cast(gamma, x.dtype), ops.cast(beta, x.dtype)
        y = tf.reshape(normalise(tf.reshape(x, (-1, width)), gamma, beta), tf.shape(x))
    y.set_shape(x.shape)
    return y


def _attend_with_gradient(query, key, value):
    """softmax(query @ key^T) @ value, (..., tokens, head_dim) each, float32, with
    its gradient written out.

    The forward pass divides the attended values, not the (tokens, tokens)
    weights, by the softmax's sums. The backward pass uses
    rowsum(dP * P) = rowsum(d_attended * attended) (as FlashAttention does),
    a reduction over head_dim instead of over the keys, and needs no
    probabilities: autodiff of the plain form makes two more passes over the
    (batch, heads, tokens, tokens) tensors.
    """

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
                offset = tf.reduce_sum(upstream * attended, -1, keepdims=True) * inverse_sum
                logits_gradient = weights * (tf.matmul(scaled, value, transpose_b=True) - offset)
                return (
                    tf.matmul(logits_gradient, key),
                    tf.matmul(logits_gradient, query, transpose_a=True),
                    value_gradient,
                )

        return attended, gradient

    return attend(query, key, value)


def _attention_with_gradient(qkv, num_heads):
    """The reference float32 `attention` without dropout, its gradient written out."""
    return reference.merge_heads(_attend_with_gradient(*reference.split_qkv(qkv, num_heads)))


def attention_for_training(qkv, num_heads, dropout=None):
    """The reference `attention`'s attended values in training.

    An even static batch (`drop_remainder=True`, as XLA and TPU training use)
    is attended in two independent halves: XLA's CPU runtime runs a batched
    matmul as a loop of small matmuls, and two independent halves keep both
    cores of a small machine busy. With attention dropout each half draws its
    own mask, so a seeded run's masks differ from those of one piece. In
    float32 without dropout the attention has its gradient written out
    (`_attend_with_gradient`).
    """

    def attend(qkv):
        if qkv.dtype == tf.float32 and dropout is None:
            return _attention_with_gradient(qkv, num_heads)
        return reference.attention(qkv, num_heads, training=True, dropout=dropout)[0]

    batch = qkv.shape[0]
    if batch is not None and batch >= 2 and batch % 2 == 0:
        return tf.concat([attend(half) for half in tf.split(qkv, 2, axis=0)], axis=0)
    return attend(qkv)


def attention_for_inference(qkv, num_heads):
    """The reference `attention`'s attended values in inference, for TensorFlow with oneDNN.

    16-bit logits go to the softmax without the casts to float32
    and back: oneDNN's softmax computes in float32 whatever its input type, so
    the rounded probabilities are the same without the two passes.
    """
    if qkv.dtype == tf.float32:
        return reference.attention(qkv, num_heads)[0]
    query, key, value = reference.split_qkv(qkv, num_heads)
    probabilities = tf.nn.softmax(tf.matmul(query, key, transpose_b=True), axis=-1)
    return reference.merge_heads(tf.matmul(probabilities, value))


def dropout_in_xla(x, rate, seed_generator):
    """The reference `dropout` with masks drawn by ThreeFry, for XLA-compiled steps.

    TensorFlow's stateless dropout draws Philox numbers by default. XLA's CPU
    backend computes Philox's 32x32->64-bit products one element at a time,
    while ThreeFry-2x32 (Salmon et al. 2011, JAX's default generator) is 32-bit
    additions, rotations and xors that vectorise. TensorFlow's CPU kernels
    without XLA have no ThreeFry. Same distribution: each element is kept with
    probability 1 - rate and scaled by 1 / (1 - rate).
    """
    seed = seed_generator.next()
    if seed.dtype != tf.int32:  # The stateless ops take int32 seeds under XLA.
        seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
    return tf.nn.experimental.stateless_dropout(x, rate=rate, seed=seed, rng_alg="threefry")


def int8_dense_for_inference(x, kernel, kernel_scale, bias, dtype, frozen=False):
    """The reference `int8_dense` with Keras' default quantizer, through oneDNN's u8 x s8 matmul
    (`QuantizedMatMulWithBiasAndDequantize`, VNNI or AMX instructions where the CPU has them).

    oneDNN's kernel takes unsigned activations and one scale per operand, so x is quantized per tensor:
    shifted by its minimum m (m <= 0) onto [0, max - m], rounded to 255 levels, and the shift given back
    through the bias, m times each column's sum of the float kernel. The kernel's per-column scales leave the
    matmul as a division of its result: oneDNN sees weights of scale 1. The dequantised product differs
    from the reference (abs-max per token) by rounding only: both are x @ kernel + bias within half an
    activation step per term. Needs TensorFlow's oneDNN CPU kernels (a CPU without them fails to run it).

    `frozen`: the kernel's column sums are read once, when traced, into the graph (for a SavedModel, whose
    weights no longer change); otherwise summed at each call.
    """
    shape = tuple(kernel.shape)
    depth = shape[0]
    matrix = tf.reshape(kernel, (depth, -1))
    # The float kernel is int8 values / kernel_scale, column by column.
    scale = tf.reshape(tf.cast(kernel_scale, tf.float32), (-1,))
    rows = tf.reshape(tf.cast(x, tf.float32), (-1, depth))
    low = tf.minimum(tf.reduce_min(rows), 0.0)
    span = tf.maximum(tf.reduce_max(rows) - low, 1e-12)
    quantized = tf.raw_ops.QuantizeV2(
        input=rows - low, min_range=0.0, max_range=span, T=tf.quint8, mode="SCALED", round_mode="HALF_TO_EVEN"
    )
    if frozen:
        with tf.init_scope():
            sums = np.reshape(ops.convert_to_numpy(kernel), (depth, -1)).astype(np.float32).sum(axis=0)
        int8_sums = tf.constant(sums)
    else:
        int8_sums = tf.reduce_sum(tf.cast(matrix, tf.float32), axis=0)
    # In the int8 values' units (before the division by the scale): the shift given back, and the bias.
    shift = low * int8_sums
    if bias is not None:
        shift += tf.reshape(tf.cast(bias, tf.float32), (-1,)) * scale
    y = tf.raw_ops.QuantizedMatMulWithBiasAndDequantize(
        a=quantized.output, b=tf.bitcast(matrix, tf.qint8), bias=shift, min_a=quantized.output_min,
        max_a=quantized.output_max, min_b=-127.0, max_b=127.0, min_freezed_output=-1.0, max_freezed_output=1.0,
        Toutput=tf.float32, input_quant_mode="SCALED",
    )  # fmt: skip
    return tf_ops.unflatten_rows(tf.cast(y / scale, dtype), x, shape[1:])
