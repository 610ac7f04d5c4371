import inspect

import keras
import numpy as np
import pytest

from keras_vit import layers as vit_layers
from keras_vit import resnet
from keras_vit.testing import random_images
from tests import numpy_vit

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
    (vit_layers.PatchEncoder, dict(hidden_dim=8, patch_size=(4, 2), position_embedding="sincos2d"), (2, 8, 12, 3), 3),
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
    (vit_layers.TransformerBlock, dict(num_heads=2, mlp_dim=16, activation="gelu_tanh"), (2, 5, 8), 12),
    (vit_layers.TokenPooling, dict(method="gap"), (2, 5, 8), 0),
    (vit_layers.MAPHead, dict(num_heads=2, mlp_dim=16, activation="gelu_tanh", layer_norm_epsilon=1e-5), (2, 5, 8), 13),
    (vit_layers.Dropout, dict(rate=0.2, seed=4), (2, 5, 8), 0),
    (vit_layers.Dense, dict(units=6, activation="gelu"), (2, 5, 8), 2),
    (vit_layers.LayerNormalization, dict(epsilon=1e-6), (2, 5, 8), 2),
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
    # get_config returns exactly the constructor's arguments (plus the base Layer's); the Keras
    # layers computed by the kernels keep Keras' constructor and config.
    params = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    if "__init__" in vars(cls):
        assert set(config) - BASE_LAYER_KEYS == params
    else:
        keras_layer = cls.__mro__[1]
        assert keras_layer.__module__.startswith("keras") and set(config) == set(keras_layer(**kwargs).get_config())
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
        (lambda: vit_layers.TransformerBlock(2, 8, activation="erf"), r"activation='erf'"),
        (lambda: vit_layers.TokenPooling("max"), r"method='max'"),
        (lambda: vit_layers.PatchEncoder(8, 4, position_embedding="fixed"), r"position_embedding='fixed'"),
        (lambda: vit_layers.PatchEncoder(10, 4, position_embedding="sincos2d"), r"multiple of 4.*hidden_dim=10"),
        (lambda: vit_layers.PatchEncoder(4, 4, position_embedding="sincos2d"), r"at least 8.*hidden_dim=4"),
        (lambda: vit_layers.MAPHead(0, 8), r"num_heads=0"),
        (lambda: vit_layers.MAPHead(2, 8, activation="fast"), r"activation='fast'"),
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
    with pytest.raises(ValueError, match=r"MAPHead.*input_shape=\(1, 4, 8\), num_heads=3"):
        vit_layers.MAPHead(3, 8)(np.zeros((1, 4, 8), "float32"))


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
    for i, dense in enumerate((mha.query_dense, mha.key_dense, mha.value_dense)):
        dense.kernel.assign(kernel[:, i].reshape(hidden, heads, head_dim))
        dense.bias.assign(bias[i].reshape(heads, head_dim))
    mha.output_dense.kernel.assign(attention.output_kernel.numpy().reshape(heads, head_dim, hidden))
    mha.output_dense.bias.assign(attention.output_bias.numpy())

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


# === GELU ===


def numpy_gelu_exact(x):
    from scipy.special import erf

    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def test_tanh_gelu_dense_matches_numpy_in_every_form():
    """Dense with `gelu_tanh` equals the NumPy formula within 1e-5: eager, in a TensorFlow graph
    (tf.nn.gelu(approximate=True) after the fused matmul) and in the portable reference form; it
    differs from the exact GELU by more than that; the activation survives serialization."""
    import tensorflow as tf

    from keras_vit import kernels
    from keras_vit.layers.core import gelu_tanh

    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 1.0, (2, 5, 8)).astype("float32")
    dense = vit_layers.Dense(6, activation=gelu_tanh)
    dense.build(x.shape)
    dense.set_weights([rng.normal(0.0, 1.0, (8, 6)), rng.normal(0.0, 1.0, (6,))])
    pre = x.astype(np.float64) @ dense.kernel.numpy().astype(np.float64) + dense.bias.numpy()
    expected = numpy_vit.gelu_tanh(pre)
    with kernels.portable_ops():
        portable = keras.ops.convert_to_numpy(dense(x))
    for got in (keras.ops.convert_to_numpy(dense(x)), tf.function(dense)(x).numpy(), portable):
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert np.abs(got - numpy_gelu_exact(pre)).max() > 1e-4
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(dense))
    assert clone.activation is gelu_tanh


@pytest.mark.parametrize("activation, function", [("gelu", numpy_gelu_exact), ("gelu_tanh", numpy_vit.gelu_tanh)])
def test_transformer_block_activation_option(activation, function):
    """The block's MLP computes the GELU it was built with."""
    block = vit_layers.TransformerBlock(num_heads=2, mlp_dim=16, activation=activation)
    block.build((None, 5, 8))
    dense = block.mlp_dense_1
    rng = np.random.default_rng(1)
    dense.set_weights([rng.normal(0.0, 1.0, w.shape) for w in dense.weights])
    x = rng.normal(0.0, 1.0, (2, 5, 8)).astype("float32")
    expected = function(x.astype(np.float64) @ dense.kernel.numpy() + dense.bias.numpy())
    np.testing.assert_allclose(keras.ops.convert_to_numpy(dense(x)), expected, atol=1e-5)


# === Fixed 2-D sin-cos position embeddings ===


@pytest.mark.parametrize("grid, width", [((4, 4), 16), ((3, 5), 8), ((7, 2), 64)])
def test_sincos_position_embeddings_are_big_visions_formula(grid, width):
    got = vit_layers.sincos_position_embedding(grid, width)
    assert got.dtype == np.float32 and got.shape == (grid[0] * grid[1], width)
    np.testing.assert_allclose(got[None], numpy_vit.posemb_sincos_2d(*grid, width), atol=1e-6)


@pytest.mark.parametrize("use_class_token", [True, False])
def test_sincos_patch_encoder_adds_the_fixed_embeddings(use_class_token):
    """Rectangular grid (2 x 6 patches): the tokens of a zero projection are the embeddings
    themselves, the class token (zero) gets no position, and nothing of it is a weight."""
    encoder = vit_layers.PatchEncoder(16, (4, 2), use_class_token=use_class_token, position_embedding="sincos2d")
    images = random_images((2, 8, 12, 3))
    encoder.build(images.shape)
    assert [w.name for w in encoder.weights] == ["kernel", "bias"] + ["class_token"] * use_class_token
    encoder.kernel.assign(np.zeros(encoder.kernel.shape))
    expected = numpy_vit.posemb_sincos_2d(2, 6, 16)
    if use_class_token:
        expected = np.concatenate([np.zeros((1, 1, 16)), expected], axis=1)
    tokens = keras.ops.convert_to_numpy(encoder(images))
    np.testing.assert_allclose(tokens, np.repeat(expected, 2, axis=0), atol=1e-6)
    np.testing.assert_allclose(encoder.position_embedding, expected, atol=1e-6)


# === MAP head ===


@pytest.mark.parametrize("activation, function", [("gelu", numpy_gelu_exact), ("gelu_tanh", numpy_vit.gelu_tanh)])
def test_map_head_matches_numpy_reference(activation, function):
    from keras_vit import checkpoints

    dim, heads, mlp_dim = 16, 4, 24
    rng = np.random.default_rng(2)
    params = numpy_vit.random_map_head_params(rng, dim, heads, mlp_dim)
    assert sum(v.size for v in params.values()) == numpy_vit.map_head_params(dim, mlp_dim)
    head = vit_layers.MAPHead(heads, mlp_dim, activation=activation)
    tokens = rng.normal(0.0, 1.0, (3, 7, dim)).astype("float32")
    head.build(tokens.shape)
    assert head.count_params() == numpy_vit.map_head_params(dim, mlp_dim)
    # The checkpoint converter's mapping (big_vision names -> this layer's weights).
    shapes = {f"pooling/{w.path.split('/', 1)[1]}": tuple(w.shape) for w in head.weights}
    canonical = {f"MAPHead_0/{key}": value for key, value in params.items()}
    weights, _ = checkpoints.convert_checkpoint(canonical, shapes, (1, 1))
    for weight in head.weights:
        weight.assign(weights[f"pooling/{weight.path.split('/', 1)[1]}"])
    expected = numpy_vit.map_head(tokens, params, function)
    got = keras.ops.convert_to_numpy(head(tokens))
    assert got.shape == (3, dim)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert np.ptp(expected, axis=0).max() > 0.1  # The probe's output depends on the tokens.
    # Its attention as the fused form (`keras.ops.dot_product_attention`, what a GPU or TPU runs off
    # TensorFlow): the same numbers.
    from keras_vit import kernels

    with kernels.fused_attention(True):
        fused = keras.ops.convert_to_numpy(head(tokens))
    np.testing.assert_allclose(fused, expected, atol=1e-5, rtol=1e-5)
