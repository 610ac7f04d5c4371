"""keras_vit.kernels' dense layer, layer norm, GELU and dropout: the reference forms against NumPy, the TensorFlow
and CPU forms against the reference (their gradients too), the dropout masks of XLA-compiled CPU steps, and the
matmul and bias TensorFlow fuses."""


import keras
import numpy as np
import pytest

from keras_vit import kernels
from keras_vit.kernels import reference
from tests.kernel_helpers import HERE_AND_WITH_ONEDNN, seeded, tensorflow_only, traced_output_and_gradients


def test_reference_layer_norm_dense_and_gelu():
    rng = seeded(1)
    x = rng.normal(2.0, 3.0, (3, 5, 16)).astype("float32")
    gamma, beta = rng.normal(1.0, 0.5, 16).astype("float32"), rng.normal(0.0, 0.5, 16).astype("float32")
    centred = x - x.mean(-1, keepdims=True)
    expected = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6) * gamma + beta
    np.testing.assert_allclose(np.asarray(reference.layer_norm(x, gamma, beta, 1e-6)), expected, rtol=1e-5, atol=1e-5)

    from scipy.special import erf

    kernel, bias = rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=8).astype("float32")
    pre = x @ kernel + bias
    np.testing.assert_allclose(np.asarray(reference.dense(x, kernel, bias)), pre, rtol=1e-5, atol=1e-4)
    gelu = 0.5 * pre * (1 + erf(pre / np.sqrt(2)))
    np.testing.assert_allclose(np.asarray(reference.dense(x, kernel, bias, "gelu")), gelu, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"activation='relu'"):
        kernels.dense(x, kernel, bias, activation="relu")


def test_dense_contracts_the_last_axis_with_a_kernel_of_any_rank():
    """The attention's (hidden, 3, hidden) kernel and (3, hidden) bias give (..., 3, hidden): the
    flat (hidden, 3 * hidden) product, reshaped."""
    rng = seeded(10)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    kernel, bias = rng.normal(size=(8, 3, 4)).astype("float32"), rng.normal(size=(3, 4)).astype("float32")
    want = (x @ kernel.reshape(8, 12) + bias.reshape(12)).reshape(2, 5, 3, 4)
    for activation in (None, "gelu"):
        got = keras.ops.convert_to_numpy(reference.dense(x, kernel, bias, activation))
        assert got.shape == (2, 5, 3, 4)
        if activation is None:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        entry_point = keras.ops.convert_to_numpy(kernels.dense(x, kernel, bias, activation))
        np.testing.assert_allclose(got, entry_point, rtol=1e-5, atol=1e-5)


@tensorflow_only
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_tensorflow_dense_matches_the_reference(dtype, tolerance):
    from keras_vit.kernels import tf_ops

    rng = seeded(2)
    x = keras.ops.cast(rng.normal(size=(2, 9, 16)), dtype)
    flat = rng.normal(0, 0.3, (16, 24)).astype("float32"), rng.normal(size=24).astype("float32")
    stacked = (flat[0].reshape(16, 3, 8), flat[1].reshape(3, 8))  # The attention's layout.
    for (kernel, bias), shape in ((flat, (2, 9, 24)), (stacked, (2, 9, 3, 8))):
        for activation in (None, "gelu"):
            got = tf_ops.dense(x, kernel, bias, activation)
            want = reference.dense(x, kernel, bias, activation)
            assert got.dtype == want.dtype == x.dtype and tuple(got.shape) == tuple(want.shape) == shape
            np.testing.assert_allclose(
                keras.ops.convert_to_numpy(keras.ops.cast(got, "float32")),
                keras.ops.convert_to_numpy(keras.ops.cast(want, "float32")),
                rtol=tolerance,
                atol=tolerance,
            )


@tensorflow_only
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_cpu_inference_layer_norm_matches_the_reference(dtype, tolerance):
    import tensorflow as tf

    from keras_vit.kernels import tf_cpu

    rng = seeded(3)
    x = tf.cast(rng.normal(2.0, 3.0, (3, 7, 40)), dtype)
    gamma, beta = rng.normal(1.0, 0.5, 40).astype("float32"), rng.normal(0.0, 0.5, 40).astype("float32")
    want = reference.layer_norm(x, gamma, beta, 1e-6)
    for function in (tf_cpu.layer_norm_for_inference, tf.function(tf_cpu.layer_norm_for_inference)):
        got = function(x, gamma, beta, 1e-6)
        assert got.dtype == x.dtype
        np.testing.assert_allclose(
            tf.cast(got, tf.float32).numpy(), tf.cast(want, tf.float32).numpy(), rtol=tolerance, atol=tolerance
        )
    # Followed by an add that broadcasts (position embeddings after a patch norm): Grappler would merge it with
    # `+ beta` and hand the sum to the fused layer norm as its offset, which fails.
    positions = rng.normal(0.0, 1.0, (1, 7, 40)).astype("float32")
    then_add = tf.function(lambda x: tf_cpu.layer_norm_for_inference(x, gamma, beta, 1e-6) + tf.cast(positions, dtype))
    np.testing.assert_allclose(tf.cast(then_add(x), tf.float32).numpy(),
                               tf.cast(want + tf.cast(positions, dtype), tf.float32).numpy(), rtol=tolerance,
                               atol=2 * tolerance)  # fmt: skip
    # Gradients pass through it (a frozen layer's norm is traced in this form while what follows trains).
    if dtype == "float32":
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            weights = tf.constant(rng.normal(0.0, 1.0, (3, 7, 40)), tf.float32)
            got = tf.reduce_sum(tf_cpu.layer_norm_for_inference(x, gamma, beta, 1e-6) * weights)
            want = tf.reduce_sum(reference.layer_norm(x, gamma, beta, 1e-6) * weights)
        np.testing.assert_allclose(tape.gradient(got, x).numpy(), tape.gradient(want, x).numpy(), atol=1e-4)


@tensorflow_only
@pytest.mark.parametrize("jit_compile", [True, False])
def test_cpu_training_layer_norm_matches_the_reference_and_its_gradients(jit_compile):
    from keras_vit.kernels import tf_cpu

    rng = seeded(4)
    x = rng.normal(2.0, 3.0, (3, 7, 40)).astype("float32")
    gamma, beta = rng.normal(1.0, 0.5, 40).astype("float32"), rng.normal(0.0, 0.5, 40).astype("float32")
    upstream = rng.normal(size=(3, 7, 40)).astype("float32")
    got = traced_output_and_gradients(
        lambda x, g, b: tf_cpu.layer_norm_for_training(x, g, b, 1e-6), [x, gamma, beta], upstream, jit_compile
    )
    want = traced_output_and_gradients(
        lambda x, g, b: reference.layer_norm(x, g, b, 1e-6), [x, gamma, beta], upstream, jit_compile
    )
    for name, g, w in zip(("output", "input", "gamma", "beta"), got, want):
        assert np.abs(w).max() > 0.1, name  # Values that could differ.
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)


@tensorflow_only
@pytest.mark.parametrize("jit_compile", [True, False])
def test_dropout_masks_come_from_threefry_in_xla_compiled_cpu_steps(jit_compile):
    import tensorflow as tf

    from keras_vit.layers import Dropout

    def algorithms(function, *args):
        """The `alg` inputs (TensorFlow's Algorithm enum: 1 Philox, 2 ThreeFry, 3 auto) of the
        stateless random ops traced by `function`."""
        graph = function.get_concrete_function(*args).graph
        return sorted(
            int(tf.get_static_value(op.inputs[3]))
            for op in graph.get_operations()
            if op.type == "StatelessRandomUniformV2"
        )

    rate = 0.25
    layer = Dropout(rate, seed=7)
    x = tf.ones((64, 65, 128))
    step = tf.function(lambda x: layer(x, training=True), jit_compile=jit_compile)
    # XLA compiles ThreeFry; TensorFlow's CPU kernels have Philox only (auto picks it).
    assert algorithms(step, x) == ([2] if jit_compile else [3])

    first, second = np.asarray(step(x)), np.asarray(step(x))
    for out in (first, second):
        # Kept elements scaled by 1 / (1 - rate), the rest zero, at the rate:
        # 532,480 draws, so the fraction's standard deviation is 6e-4.
        np.testing.assert_allclose(out[out != 0], 1 / (1 - rate), rtol=1e-6)
        assert abs((out == 0).mean() - rate) < 4e-3
    assert (first != second).mean() > 0.3  # A new mask each call.
    again = Dropout(rate, seed=7)  # The same seed gives the same masks.
    replay = tf.function(lambda x: again(x, training=True), jit_compile=jit_compile)
    np.testing.assert_array_equal(replay(x), first)
    np.testing.assert_array_equal(layer(x, training=False), x)


@tensorflow_only
@HERE_AND_WITH_ONEDNN
def test_tensorflow_fuses_the_dense_forms_matmul_and_bias(process):
    """What `dense`'s 2-D MatMul + BiasAdd form is for: TensorFlow's optimiser runs each projection
    as one fused kernel, with the GELU inside it where oneDNN is on."""
    import keras_vit
    from keras_vit import compat
    from keras_vit.testing import traced_op_times

    block = keras_vit.TransformerBlock(num_heads=2, mlp_dim=32)
    block.build((None, 9, 16))
    for weight in block.weights:  # Zero biases would be folded away before fusion.
        weight.assign(seeded(9).normal(0.0, 0.2, weight.shape))
    ops = [op for op, _ in traced_op_times(lambda x: block(x), np.ones((2, 9, 16), "float32"))]
    fused = "_MklNativeFusedMatMul" if compat.onednn_enabled() else "_FusedMatMul"
    assert ops.count(fused) == 4 and "BiasAdd" not in ops, ops  # QKV, attention output, MLP 1 and 2.
    if compat.onednn_enabled():
        assert "Erf" not in ops and ops.count("_MklLayerNorm") == 2, ops
