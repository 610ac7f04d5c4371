"""`keras_vit.kernels.int8_dense`: Keras' int8 matmul and oneDNN's, and which one a trace takes."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_vit import compat, kernels
from keras_vit.kernels import reference, tf_cpu
from keras_vit.layers.core import Dense


def _quantized(shape, seed):
    """An int8 kernel of `shape` with a scale per column (Keras' convention: float = int8 / scale), its float
    value, and a bias."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(0, 0.05, shape) * rng.uniform(0.2, 2.0, shape[1:])
    scale = 127 / np.abs(weights).max(axis=0)
    values = np.round(weights * scale).astype(np.int8)
    return values, scale.astype(np.float32), (values / scale).astype(np.float32), rng.normal(0, 1, shape[1:])


def _inputs(rows, depth, seed):
    x = np.random.default_rng(seed).normal(0.3, 1.0, (2, rows, depth)).astype(np.float32)
    x[..., 3] *= 8.0  # An outlier channel, as a ViT's normalised tokens have.
    return x


def _ops(function, *specs):
    return {node.op for node in function.get_concrete_function(*specs).graph.as_graph_def().node}


@pytest.mark.parametrize("shape", [(48, 40), (48, 3, 16)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_onednn_int8_matmul_is_the_product_within_half_an_activation_step_per_term(shape, with_bias):
    values, scale, dequantized, bias = _quantized(shape, seed=len(shape))
    bias = bias.astype(np.float32) if with_bias else None
    x = _inputs(7, shape[0], seed=1)
    exact = np.einsum("btk,k...->bt...", x.astype(np.float64), dequantized.astype(np.float64))
    if with_bias:
        exact = exact + bias
    step = (x.max() - min(x.min(), 0.0)) / 255  # One activation step: the tensor's range over 255 levels.
    # Each of the `depth` terms moves by at most half a step times its weight's magnitude; float32 sums on top.
    bound = 0.5 * step * np.abs(dequantized).sum(axis=0) * (1 + 1e-3) + 1e-5 * np.abs(exact).max()
    for frozen in (False, True):
        y = tf.function(lambda x, frozen=frozen: tf_cpu.int8_dense_for_inference(x, values, scale, bias, "float32",
                                                                                 frozen))(x)  # fmt: skip
        assert y.shape == exact.shape and y.dtype == tf.float32
        assert (np.abs(y.numpy() - exact) <= bound).all(), np.abs(y.numpy() - exact).max()
    # Keras' own form (per-token activations) approximates the same product.
    keras_form = reference.int8_dense(x, values, scale, bias, "float32", keras.quantizers.AbsMaxQuantizer())
    assert np.abs(keras.ops.convert_to_numpy(keras_form) - exact).max() < 0.02 * np.abs(exact).max()


def test_int8_dense_takes_onednn_inside_cpu_serving_even_without_onednn_here(monkeypatch):
    values, scale, _, bias = _quantized((16, 8), seed=3)
    quantizer = keras.quantizers.AbsMaxQuantizer()
    spec = tf.TensorSpec((4, 16), tf.float32)

    def traced(inputs_quantizer=quantizer, training=False):
        return tf.function(
            lambda x: kernels.int8_dense(x, values, scale, bias, "float32", inputs_quantizer, training=training)
        )

    fast = "QuantizedMatMulWithBiasAndDequantize"
    assert (fast in _ops(traced(), spec)) == compat.onednn_enabled()
    monkeypatch.setattr(compat, "onednn_enabled", lambda: False)  # A CPU where TensorFlow leaves oneDNN off.
    assert fast not in _ops(traced(), spec)
    with kernels.portable_ops():
        assert fast not in _ops(traced(), spec)
        with kernels.cpu_serving():  # A SavedModel for CPUs that run it, exported from one that does not.
            assert fast in _ops(traced(), spec)
            # Training, a weight-only layer and a quantizer of another range keep Keras' form.
            assert fast not in _ops(traced(training=True), spec)
            assert fast not in _ops(traced(inputs_quantizer=None), spec)
            other = keras.quantizers.AbsMaxQuantizer(value_range=(-63, 63))
            assert fast not in _ops(traced(inputs_quantizer=other), spec)
    monkeypatch.setattr(compat, "onednn_enabled", lambda: True)
    assert fast in _ops(traced(), spec)
    assert fast not in _ops(tf.function(traced().python_function, jit_compile=True), spec)  # no XLA kernel


def test_a_quantized_dense_layer_serves_through_int8_dense_and_trains_through_keras():
    layer = Dense(8, activation="gelu")
    x = _inputs(5, 12, seed=2)
    layer.build(x.shape)
    float_y = keras.ops.convert_to_numpy(layer(x))
    layer.quantize("int8")
    y = tf.function(lambda x: layer(x, training=False))(x).numpy()
    assert np.abs(y - float_y).max() < 0.05 * np.abs(float_y).max()
    with tf.GradientTape() as tape:
        inputs = tf.constant(x)
        tape.watch(inputs)
        out = layer(inputs, training=True)
    gradient = tape.gradient(out, inputs)
    assert gradient is not None and np.isfinite(gradient.numpy()).all() and np.abs(gradient.numpy()).sum() > 0
