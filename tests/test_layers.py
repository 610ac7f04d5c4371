import inspect

import keras
import numpy as np
import pytest

from keras_vit import layers as vit_layers
from keras_vit import resnet
from tests.conftest import random_images

BASE_LAYER_KEYS = {"name", "trainable", "dtype"}

# (layer class, constructor kwargs, input shape, trainable weights).
LAYER_CASES = [
    (vit_layers.Patches, dict(patch_size=(4, 2)), (2, 8, 6, 3), 0),
    (vit_layers.PatchEncoder, dict(hidden_dim=8, patch_size=4), (2, 8, 12, 3), 4),
    (
        vit_layers.PatchEncoder,
        dict(hidden_dim=8, patch_size=(2, 4), use_class_token=False, projection="matmul"),
        (2, 8, 12, 3),
        3,
    ),
    (vit_layers.MultiHeadSelfAttention, dict(num_heads=2, dropout_rate=0.1, seed=3), (2, 5, 8), 4),
    (
        vit_layers.TransformerBlock,
        dict(
            num_heads=2,
            mlp_dim=16,
            dropout_rate=0.1,
            attention_dropout_rate=0.1,
            stochastic_depth_rate=0.2,
            layer_norm_epsilon=1e-5,
            seed=1,
        ),
        (2, 5, 8),
        12,
    ),
    (vit_layers.TokenPooling, dict(method="gap"), (2, 5, 8), 0),
    (vit_layers.Dropout, dict(rate=0.2, seed=4), (2, 5, 8), 0),
    (resnet.StandardizedConv2D, dict(filters=4, kernel_size=3, padding="same"), (1, 6, 6, 3), 2),
    (resnet.BottleneckUnit, dict(features=32, strides=2), (1, 8, 8, 64), 12),
    (resnet.ResNetStem, dict(num_layers=(1, 1), width_factor=1), (1, 32, 32, 3), 3 + 12 + 12),
]


@pytest.mark.parametrize("cls, kwargs, shape, num_trainable", LAYER_CASES)
def test_layer_config_round_trip(cls, kwargs, shape, num_trainable):
    layer = cls(**kwargs)
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    expected = layer(x)
    assert len(layer.trainable_weights) == num_trainable
    assert tuple(expected.shape) == layer.compute_output_shape(shape)

    config = layer.get_config()
    # get_config returns exactly the constructor's arguments (plus the base Layer's).
    params = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    assert set(config) - BASE_LAYER_KEYS == params
    for key, value in kwargs.items():
        if key not in ("patch_size", "kernel_size"):  # normalised to pairs
            assert config[key] == value

    # Through the serialization registry, as a .keras file does.
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == f"keras_vit>{cls.__name__}"
    clone = keras.saving.deserialize_keras_object(serialized)
    assert type(clone) is cls
    assert clone.get_config() == config
    if not clone.built:  # A serialized layer carries its build config.
        clone.build(shape)
    clone.set_weights(layer.get_weights())
    np.testing.assert_array_equal(clone(x), expected)


def test_patches_order_matches_a_manual_split():
    images = random_images((2, 8, 12, 3))
    patches = np.asarray(vit_layers.Patches((4, 3))(images))
    assert patches.shape == (2, 8, 36)
    # Patch 5 is grid row 1, column 1: rows 4..8, columns 3..6, flattened (row, col, channel).
    np.testing.assert_array_equal(patches[:, 5], images[:, 4:8, 3:6, :].reshape(2, -1))


@pytest.mark.parametrize("patch_size, image_shape", [(4, (2, 16, 16, 3)), ((2, 4), (3, 6, 12, 1))])
def test_conv_and_matmul_projection_agree(patch_size, image_shape):
    images = np.random.default_rng(1).normal(size=image_shape).astype("float32")
    conv = vit_layers.PatchEncoder(16, patch_size, projection="conv")
    matmul = vit_layers.PatchEncoder(16, patch_size, projection="matmul")
    conv.build(image_shape)
    matmul.build(image_shape)
    weights = [np.random.default_rng(2).normal(size=w.shape) for w in conv.weights]
    conv.set_weights(weights)
    matmul.set_weights(weights)
    np.testing.assert_allclose(conv(images), matmul(images), atol=1e-5)


def test_patch_encoder_initialisation():
    encoder = vit_layers.PatchEncoder(64, 4)
    encoder.build((1, 32, 32, 3))
    np.testing.assert_array_equal(encoder.class_token.numpy(), 0.0)
    pos = encoder.position_embedding.numpy()
    assert pos.shape == (1, 65, 64)
    assert abs(pos.std() - 0.02) < 0.002 and abs(pos.mean()) < 0.002


def test_attention_returns_row_stochastic_scores():
    attention = vit_layers.MultiHeadSelfAttention(num_heads=4)
    x = np.random.default_rng(0).normal(size=(2, 7, 16)).astype("float32")
    out, scores = attention(x, return_attention_scores=True)
    assert tuple(out.shape) == (2, 7, 16)
    assert tuple(scores.shape) == (2, 4, 7, 7)
    np.testing.assert_allclose(np.asarray(scores).sum(-1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(attention(x), out)


def test_fused_attention_matches_the_explicit_form(monkeypatch):
    """`keras.ops.dot_product_attention` (the path for GPUs and TPUs off TensorFlow), forced here,
    gives the explicit form's numbers; scores and attention dropout keep the explicit form."""
    calls = []
    fused = keras.ops.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("flash_attention"))
        return fused(*args, **kwargs)

    monkeypatch.setattr(vit_layers.ops, "dot_product_attention", spy)
    assert not vit_layers._fused_attention_path()  # TensorFlow on a CPU: the explicit form.
    attention = vit_layers.MultiHeadSelfAttention(num_heads=3, dropout_rate=0.5, seed=0)
    attention.build((None, 11, 24))
    rng = np.random.default_rng(0)
    for weight in attention.weights:
        weight.assign(rng.normal(0.0, 0.3, weight.shape))
    x = rng.normal(size=(2, 11, 24)).astype("float32")
    explicit, scores = attention(x, return_attention_scores=True)
    assert not calls
    with vit_layers.fused_attention(True):
        np.testing.assert_allclose(np.asarray(attention(x)), np.asarray(explicit), rtol=1e-5, atol=1e-5)
        assert calls == [None]
        attention(x, return_attention_scores=True)
        attention(x, training=True)  # Dropout on the probabilities: explicit.
        assert calls == [None]
        attention.dropout_rate = 0.0  # Training asks for no flash kernel (no backward for 197 tokens).
        np.testing.assert_allclose(
            np.asarray(attention(x, training=True)), np.asarray(explicit), rtol=1e-5, atol=1e-5
        )
        assert calls == [None, False]
    with vit_layers.fused_attention(False):
        attention(x)
    assert len(calls) == 2


def _random_algorithms(function, *args):
    """The `alg` inputs (TensorFlow's Algorithm enum: 1 Philox, 2 ThreeFry, 3
    auto) of the stateless random ops traced by `function`."""
    import tensorflow as tf

    graph = function.get_concrete_function(*args).graph
    return sorted(
        int(tf.get_static_value(op.inputs[3]))
        for op in graph.get_operations()
        if op.type == "StatelessRandomUniformV2"
    )


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's XLA context")
@pytest.mark.parametrize("jit_compile", [True, False])
def test_dropout_masks_come_from_threefry_in_xla_compiled_cpu_steps(jit_compile):
    import tensorflow as tf

    rate = 0.25
    layer = vit_layers.Dropout(rate, seed=7)
    x = tf.ones((64, 65, 128))
    step = tf.function(lambda x: layer(x, training=True), jit_compile=jit_compile)
    # XLA compiles ThreeFry; TensorFlow's CPU kernels have Philox only (auto picks it).
    assert _random_algorithms(step, x) == ([2] if jit_compile else [3])

    first, second = np.asarray(step(x)), np.asarray(step(x))
    for out in (first, second):
        # Kept elements scaled by 1 / (1 - rate), the rest zero, at the rate:
        # 532,480 draws, so the fraction's standard deviation is 6e-4.
        np.testing.assert_allclose(out[out != 0], 1 / (1 - rate), rtol=1e-6)
        assert abs((out == 0).mean() - rate) < 4e-3
    assert (first != second).mean() > 0.3  # A new mask each call.
    # The same seed gives the same masks.
    again = vit_layers.Dropout(rate, seed=7)
    replay = tf.function(lambda x: again(x, training=True), jit_compile=jit_compile)
    np.testing.assert_array_equal(replay(x), first)
    np.testing.assert_array_equal(layer(x, training=False), x)


def test_stochastic_depth_drops_whole_samples_in_training_only():
    block = vit_layers.TransformerBlock(num_heads=2, mlp_dim=8, stochastic_depth_rate=0.5, seed=0)
    x = np.random.default_rng(0).normal(size=(64, 3, 4)).astype("float32")
    inference = np.asarray(block(x, training=False))
    assert not np.allclose(inference, x)
    trained = np.asarray(block(x, training=True))
    unchanged = np.all(np.isclose(trained, x), axis=(1, 2))
    # Both branches dropped has probability 0.25 per sample: about 16 of 64.
    assert 4 <= unchanged.sum() <= 32


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: vit_layers.Patches(0), r"patch_size=0"),
        (lambda: vit_layers.PatchEncoder(0, 4), r"hidden_dim=0"),
        (lambda: vit_layers.PatchEncoder(8, 4, projection="fft"), r"projection='fft'"),
        (lambda: vit_layers.MultiHeadSelfAttention(-2), r"num_heads=-2"),
        (lambda: vit_layers.MultiHeadSelfAttention(2, dropout_rate=1.5), r"dropout_rate=1.5"),
        (lambda: vit_layers.TransformerBlock(2, 0), r"mlp_dim=0"),
        (lambda: vit_layers.TokenPooling("max"), r"method='max'"),
    ],
)
def test_layer_constructor_errors(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_layer_build_errors():
    with pytest.raises(ValueError, match=r"divisible by the patch size.*\(10, 12\).*\(4, 4\)"):
        vit_layers.PatchEncoder(8, 4)(np.zeros((1, 10, 12, 3), "float32"))
    with pytest.raises(ValueError, match=r"divisible by `num_heads`.*num_heads=3"):
        vit_layers.MultiHeadSelfAttention(3)(np.zeros((1, 4, 8), "float32"))


def _straightforward_block(block, hidden):
    """The same block from Keras core layers: separate Q/K/V projections, Dense, exact GELU."""
    heads = block.num_heads
    head_dim = hidden // heads
    ln1 = keras.layers.LayerNormalization(epsilon=block.layer_norm_epsilon)
    ln2 = keras.layers.LayerNormalization(epsilon=block.layer_norm_epsilon)
    mha = keras.layers.MultiHeadAttention(heads, head_dim)
    dense1 = keras.layers.Dense(block.mlp_dim, activation=lambda x: keras.activations.gelu(x, approximate=False))
    dense2 = keras.layers.Dense(hidden)
    probe = keras.ops.zeros((1, 3, hidden))
    ln1(probe), ln2(probe), mha(probe, probe), dense2(dense1(probe))
    ln1.set_weights(block.attention_norm.get_weights())
    ln2.set_weights(block.mlp_norm.get_weights())
    dense1.set_weights(block.mlp_dense_1.get_weights())
    dense2.set_weights(block.mlp_dense_2.get_weights())
    attention = block.attention
    kernel, bias = attention.qkv_kernel.numpy(), attention.qkv_bias.numpy()
    for i, dense in enumerate((mha._query_dense, mha._key_dense, mha._value_dense)):
        dense.kernel.assign(kernel[:, i * hidden : (i + 1) * hidden].reshape(hidden, heads, head_dim))
        dense.bias.assign(bias[i * hidden : (i + 1) * hidden].reshape(heads, head_dim))
    mha._output_dense.kernel.assign(attention.output_kernel.numpy().reshape(heads, head_dim, hidden))
    mha._output_dense.bias.assign(attention.output_bias.numpy())

    def call(x):
        y = ln1(x)
        x = x + mha(y, y)
        return x + dense2(dense1(ln2(x)))

    return call


def _output_and_gradient(function, x, upstream):
    """function(x) and the gradient of <function(x), upstream> with respect to x."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch(x)
        y = function(x)
    return y, tape.gradient(y, x, output_gradients=upstream)


def _traced_output_and_gradients(function, inputs, upstream, jit_compile, variables=()):
    """[function(*inputs), then the gradients of <function(*inputs), upstream> with respect to
    each input and each of `variables`], computed in a tf.function with `jit_compile`."""
    import tensorflow as tf

    @tf.function(jit_compile=jit_compile)
    def run(*inputs):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y = function(*inputs)
        return [y, *tape.gradient(y, [*inputs, *variables], output_gradients=upstream)]

    return [t.numpy() for t in run(*inputs)]


def _random_block(seed, hidden=48, heads=3, mlp_dim=96, tokens=50):
    """(block with random weights, the straightforward block with the same weights, rng)."""
    block = vit_layers.TransformerBlock(num_heads=heads, mlp_dim=mlp_dim)
    block.build((None, tokens, hidden))
    rng = np.random.default_rng(seed)
    for weight in block.weights:
        weight.assign(rng.normal(0.0, 0.2, weight.shape) + (weight.name == "gamma"))
    return block, _straightforward_block(block, hidden), rng


@pytest.mark.parametrize("hidden, heads, mlp_dim, tokens", [(32, 4, 64, 17), (48, 3, 96, 50)])
def test_transformer_block_matches_the_straightforward_formulation(hidden, heads, mlp_dim, tokens):
    """The optimised block (one QKV matmul, 2-D matmuls with BiasAdd that oneDNN fuses with the
    GELU) gives the numbers of the textbook one built from Keras core layers, eager and in a
    graph (where TensorFlow's optimiser fuses)."""
    import tensorflow as tf

    block, reference, rng = _random_block(0, hidden, heads, mlp_dim, tokens)
    x = rng.normal(0.0, 1.0, (3, tokens, hidden)).astype("float32")
    expected = keras.ops.convert_to_numpy(reference(x))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(block(x)), expected, rtol=1e-5, atol=1e-5)
    graph = tf.function(lambda x: block(x))
    np.testing.assert_allclose(graph(x).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_training_gradients_match_the_straightforward_formulation():
    """Gradients of a training-mode block (no dropout) are the textbook block's, and the
    backward graph splits q, k and v with one op rather than three full-size StridedSliceGrads."""
    import tensorflow as tf

    hidden, tokens = 48, 50
    block, reference, rng = _random_block(1)
    x = tf.constant(rng.normal(0.0, 1.0, (2, tokens, hidden)).astype("float32"))
    upstream = tf.constant(rng.normal(0.0, 1.0, (2, tokens, hidden)).astype("float32"))

    expected = _output_and_gradient(reference, x, upstream)[1].numpy()
    traced = tf.function(lambda: _output_and_gradient(lambda x: block(x, training=True), x, upstream)[1])
    np.testing.assert_allclose(traced().numpy(), expected, rtol=1e-4, atol=1e-4)
    ops = {op.type for op in traced.get_concrete_function().graph.get_operations()}
    assert "StridedSliceGrad" not in ops, sorted(ops)


def test_training_attention_on_a_cpu_runs_in_two_halves_of_the_batch():
    """On a CPU, training-mode attention by TensorFlow ops (not the native kernels) with an even
    static batch is two independent halves; with XLA or without, the outputs and gradients are
    still the textbook block's. Inference and exports keep one piece."""
    import tensorflow as tf

    from keras_vit.training import accelerator

    if accelerator() != "cpu":
        pytest.skip("the split applies on a CPU only")
    with vit_layers.native_attention(False):
        hidden, tokens = 48, 50
        block, reference, rng = _random_block(2)

        def batch_matmuls(batch, training=True):
            spec = tf.TensorSpec((batch, tokens, hidden))
            graph = tf.function(lambda x: block(x, training=training)).get_concrete_function(spec).graph
            return [op.type for op in graph.get_operations()].count("BatchMatMulV2")

        assert batch_matmuls(4) == 4  # Logits and attended values, for each half.
        assert batch_matmuls(3) == 2 and batch_matmuls(None) == 2  # Odd or unknown: one piece.
        assert batch_matmuls(4, training=False) == 2
        with vit_layers.portable_ops():
            assert batch_matmuls(4) == 2
        assert vit_layers.MultiHeadSelfAttention(3)(np.zeros((4, 5, 6)), training=True).shape == (4, 5, 6)
        for batch, jit_compile in ((4, True), (4, False), (3, True)):
            x = tf.constant(rng.normal(0.0, 1.0, (batch, tokens, hidden)).astype("float32"))
            upstream = tf.constant(rng.normal(0.0, 1.0, (batch, tokens, hidden)).astype("float32"))
            expected = [t.numpy() for t in _output_and_gradient(reference, x, upstream)]
            got = _traced_output_and_gradients(lambda x: block(x, training=True), [x], upstream, jit_compile)
            for g, want in zip(got, expected):
                np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_training_attention_on_a_cpu_has_a_closed_form_gradient(jit_compile):
    """`_attention_for_training` gives softmax(q k^T) v and autodiff's gradients for q, k and v,
    with logits large enough that an unshifted exp would overflow; a float32 training block on
    a CPU uses it when the native kernels are off (no Softmax op), one with attention dropout
    does not."""
    import tensorflow as tf

    from keras_vit.training import accelerator

    rng = np.random.default_rng(4)
    q, k, v, upstream = (tf.constant(rng.normal(0.0, 1.0, (2, 3, 11, 8)).astype("float32")) for _ in range(4))
    q = q * 30.0  # Logits in the hundreds.

    def output_and_gradients(function):
        return _traced_output_and_gradients(function, [q, k, v], upstream, jit_compile)

    got = output_and_gradients(vit_layers._attention_for_training)
    want = output_and_gradients(lambda q, k, v: tf.matmul(tf.nn.softmax(tf.matmul(q, k, transpose_b=True)), v))
    assert np.isfinite(got[0]).all() and np.abs(want[1]).max() > 0.1
    for name, g, w in zip(("output", "query", "key", "value"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)

    if accelerator() != "cpu":
        return

    def op_types(block):
        spec = tf.TensorSpec((2, 5, 12))
        graph = tf.function(lambda x: block(x, training=True)).get_concrete_function(spec).graph
        return {op.type for op in graph.get_operations()}

    with vit_layers.native_attention(False):
        assert "Softmax" not in op_types(vit_layers.TransformerBlock(num_heads=3, mlp_dim=8))
    with_dropout = vit_layers.TransformerBlock(num_heads=3, mlp_dim=8, attention_dropout_rate=0.1)
    assert "Softmax" in op_types(with_dropout)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_training_layer_norm_on_a_cpu_is_the_keras_layer_with_a_closed_form_gradient(jit_compile):
    """In float32 training with TensorFlow on a CPU, `layer_norm` takes channel means as matmuls
    and writes the backward pass out; output and gradients (input, gamma, beta) are the Keras
    layer's, with XLA or without. Inference and exports keep their own forms."""
    import tensorflow as tf

    from keras_vit.training import accelerator

    if accelerator() != "cpu":
        pytest.skip("the closed-form layer norm applies on a CPU only")
    norm = keras.layers.LayerNormalization(epsilon=1e-6)
    norm.build((None, 7, 40))
    rng = np.random.default_rng(3)
    norm.gamma.assign(rng.normal(1.0, 0.5, 40))
    norm.beta.assign(rng.normal(0.0, 0.5, 40))
    x = tf.constant(rng.normal(2.0, 3.0, (3, 7, 40)).astype("float32"))
    upstream = tf.constant(rng.normal(0.0, 1.0, (3, 7, 40)).astype("float32"))

    def output_and_gradients(function):
        return _traced_output_and_gradients(function, [x], upstream, jit_compile, norm.trainable_weights)

    got = output_and_gradients(lambda x: vit_layers.layer_norm(x, norm, training=True))
    want = output_and_gradients(norm)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("input", "gamma", "beta"), got[1:], want[1:]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)
        assert np.abs(w).max() > 0.1, name  # Gradients that could differ.

    def op_types(training):
        spec = tf.TensorSpec((None, 7, 40))
        function = tf.function(lambda x: vit_layers.layer_norm(x, norm, training=training))
        return [op.type for op in function.get_concrete_function(spec).graph.get_operations()]

    assert "Mean" not in op_types(True) and op_types(True).count("MatMul") == 2
    assert "MatMul" not in op_types(False)
    with vit_layers.portable_ops():
        assert "MatMul" not in op_types(True)


def test_tensorflow_fuses_the_mlp_matmul_bias_and_gelu():
    """What makes the block fast on a CPU: no separate Erf/GELU op is left in the optimised graph."""
    from tensorflow.python.util import _pywrap_util_port

    from experiments.benchmark import traced_op_times

    if not _pywrap_util_port.IsMklEnabled():
        pytest.skip("TensorFlow built without oneDNN")
    block = vit_layers.TransformerBlock(num_heads=2, mlp_dim=32)
    block.build((None, 9, 16))
    for weight in block.weights:  # Zero biases would be folded away before fusion.
        weight.assign(np.random.default_rng(0).normal(0.0, 0.2, weight.shape))
    ops = [op for op, _ in traced_op_times(lambda x: block(x), np.ones((2, 9, 16), "float32"))]
    assert ops.count("_MklNativeFusedMatMul") == 4, ops  # QKV, attention output, MLP 1 and 2
    assert "Erf" not in ops and "BiasAdd" not in ops, ops
    # Both LayerNorms are oneDNN's kernel; none of the plain formula's passes is left.
    assert ops.count("_MklLayerNorm") == 2, ops
    assert not {"SquaredDifference", "Mean", "Rsqrt"} & set(ops), ops


def test_portable_ops_trace_the_plain_layer_norm():
    """Exports trace without the training-mode FusedBatchNormV3 that converters and GPUs refuse."""
    import tensorflow as tf

    block = vit_layers.TransformerBlock(num_heads=2, mlp_dim=32)
    block.build((None, 9, 16))
    spec = tf.TensorSpec((None, 9, 16))

    def op_types(function):
        return {op.type for op in function.get_concrete_function(spec).graph.get_operations()}

    fast = op_types(tf.function(lambda x: block(x)))
    training = op_types(tf.function(lambda x: block(x, training=True)))
    with vit_layers.portable_ops():
        portable = op_types(tf.function(lambda x: block(x)))
    assert "FusedBatchNormV3" in fast
    # Exports, and training steps (which the optimiser does not fuse), use the plain formula.
    assert "FusedBatchNormV3" not in portable and "PlaceholderWithDefault" not in portable
    assert "FusedBatchNormV3" not in training
