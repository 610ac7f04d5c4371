"""The native CPU attention kernels (keras_vit/native): numbers, use by the layers, build errors."""

import logging

import numpy as np
import pytest

from keras_vit import layers as vit_layers
from keras_vit import native
from tests.test_layers import _output_and_gradient, _random_block, _traced_output_and_gradients

tf = pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def library():
    """The op library, built here if the cache lacks it: a build error fails the tests that need it.
    Skipped, with the reason, on a machine with no C++ compiler (.ci/run installs one)."""
    if native._compiler() is None:
        pytest.skip("no C++ compiler on this machine: the native kernels cannot be built")
    return tf.load_op_library(native.build())


def _plain_attention(qkv, heads):
    """softmax(q k^T / sqrt(d)) v per head, with TensorFlow ops, (batch, tokens, 3 * hidden) -> (batch, tokens, hidden)."""
    batch, tokens, width = qkv.shape
    head_dim = width // (3 * heads)
    q, k, v = tf.unstack(tf.transpose(tf.reshape(qkv, (batch, tokens, 3, heads, head_dim)), (2, 0, 3, 1, 4)))
    probs = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / np.sqrt(head_dim).astype("float32"))
    return tf.reshape(tf.transpose(tf.matmul(probs, v), (0, 2, 1, 3)), (batch, tokens, heads * head_dim))


@pytest.mark.parametrize("jit_compile", [True, False])
@pytest.mark.parametrize("batch, tokens, heads, head_dim", [(3, 5, 2, 8), (2, 197, 3, 64), (1, 50, 1, 80)])
def test_native_attention_matches_the_plain_formulation(library, jit_compile, batch, tokens, heads, head_dim):
    """Output and qkv gradient of the kernels (as a TensorFlow op, and as XLA custom calls) against
    softmax(q k^T / sqrt(d)) v and its autodiff, with logits in the hundreds for some rows."""
    rng = np.random.default_rng(heads)
    qkv = rng.normal(0.0, 1.0, (batch, tokens, 3 * heads * head_dim)).astype("float32")
    qkv[:, : tokens // 2, : heads * head_dim] *= 40.0  # Large queries: an unshifted exp would overflow.
    qkv = tf.constant(qkv)
    upstream = tf.constant(rng.normal(0.0, 1.0, (batch, tokens, heads * head_dim)).astype("float32"))

    got = _traced_output_and_gradients(lambda x: vit_layers._native_attention(x, heads), [qkv], upstream, jit_compile)
    want = _traced_output_and_gradients(lambda x: _plain_attention(x, heads), [qkv], upstream, False)
    assert np.isfinite(got[1]).all() and np.abs(want[1]).max() > 0.1
    # Each of the output and the query, key and value gradients against its own largest value.
    parts = [("output", got[0], want[0], 1e-5)] + [
        (f"{name} gradient", g, w, 1e-4)
        for name, g, w in zip(("query", "key", "value"), np.split(got[1], 3, -1), np.split(want[1], 3, -1))
    ]
    for name, g, w, tolerance in parts:
        scale = max(1.0, np.abs(w).max())
        np.testing.assert_allclose(g / scale, w / scale, rtol=0, atol=tolerance, err_msg=name)


def test_native_ops_name_what_they_received(library):
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"3 \* heads \* head_dim.*\[2,5,35\].*num_heads=2"):
        library.keras_vit_attention(tf.ones((2, 5, 35)), num_heads=2)
    qkv = tf.ones((2, 5, 36))
    attended, logsumexp = library.keras_vit_attention(qkv, num_heads=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"upstream has shape \[2,5,11\], expected \[2,5,12\]"):
        library.keras_vit_attention_grad(qkv, attended, logsumexp, tf.ones((2, 5, 11)), num_heads=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"num_heads=5"):
        tf.function(lambda x: library.keras_vit_attention(x, num_heads=5), jit_compile=True)(qkv)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"head_dim >= 1.*\[2,5,36\] and num_heads=13"):
        library.keras_vit_attention(qkv, num_heads=13)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"at most 8192 tokens.*\[1,8193,3\]"):
        library.keras_vit_attention(tf.ones((1, 8193, 3)), num_heads=1)


def _op_types(block, training=True, batch=2):
    spec = tf.TensorSpec((batch, 50, 48))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = block(x, training=training)
        return tape.gradient(y, x)

    return {op.type for op in tf.function(step).get_concrete_function(spec).graph.get_operations()}


def test_float32_training_attention_on_a_cpu_runs_the_native_kernels(library):
    """A float32 training block on a CPU runs KerasVitAttention and its gradient op, with
    outputs and gradients of the textbook block (XLA or not); inference, exports, attention
    dropout, `native_attention(False)` and `KERAS_VIT_NATIVE=0` keep TensorFlow ops."""
    from keras_vit.training import accelerator

    if accelerator() != "cpu":
        pytest.skip("the native kernels are for TensorFlow on a CPU")
    block, reference, rng = _random_block(5)
    types = _op_types(block)
    assert {"KerasVitAttention", "KerasVitAttentionGrad"} <= types and "BatchMatMulV2" not in types, sorted(types)
    assert "KerasVitAttention" not in _op_types(block, training=False)
    with vit_layers.portable_ops():
        assert "KerasVitAttention" not in _op_types(block)
    with vit_layers.native_attention(False):
        assert "KerasVitAttention" not in _op_types(block)
    dropout = vit_layers.TransformerBlock(num_heads=3, mlp_dim=96, attention_dropout_rate=0.1)
    assert "KerasVitAttention" not in _op_types(dropout)

    for batch, jit_compile in ((4, True), (3, False)):
        x = tf.constant(rng.normal(0.0, 1.0, (batch, 50, 48)).astype("float32"))
        upstream = tf.constant(rng.normal(0.0, 1.0, (batch, 50, 48)).astype("float32"))
        expected = [t.numpy() for t in _output_and_gradient(reference, x, upstream)]
        got = _traced_output_and_gradients(lambda x: block(x, training=True), [x], upstream, jit_compile)
        for g, want in zip(got, expected):
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)


def _counting_native_attention(monkeypatch):
    """Counts the layers traced with `_native_attention` from here on."""
    traced = []
    real = vit_layers._native_attention
    monkeypatch.setattr(vit_layers, "_native_attention", lambda *args: traced.append(args) or real(*args))
    return traced


def test_keras_predict_and_evaluate_run_the_kernels_and_exports_do_not(library, monkeypatch, tmp_path):
    """Float32 inference traced by Keras' predict and evaluate (XLA or not) uses the kernels, with
    the numbers of the TensorFlow-op form; a model exported with `model.export` holds none of
    them and runs in a process that never loads keras_vit."""
    import subprocess
    import sys

    import keras

    import keras_vit
    from experiments.benchmark import randomized
    from keras_vit.training import accelerator
    from tests.conftest import random_images

    if accelerator() != "cpu":
        pytest.skip("the native kernels are for TensorFlow on a CPU")
    model = randomized(keras_vit.build_vit("testing", image_size=32, num_classes=10, num_layers=2))
    for weight in model.weights:  # Weights large enough for logits that differ across images.
        weight.assign(weight * 10.0)
    images = random_images((6, 32, 32, 3))
    labels = keras.utils.to_categorical(np.arange(6) % 10, 10)
    expected = model(images, training=False).numpy()  # Outside Keras' loops: TensorFlow ops.
    assert np.ptp(expected, axis=0).max() > 0.01  # Outputs that differ across images.
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    for jit_compile in (False, True):
        traced = _counting_native_attention(monkeypatch)
        model.compile(loss=loss, jit_compile=jit_compile)
        np.testing.assert_allclose(model.predict(images, verbose=0), expected, rtol=1e-5, atol=1e-7)
        assert len(traced) == 2, f"predict traced {len(traced)} layers with the kernels, expected 2"
        np.testing.assert_allclose(model.evaluate(images, labels, verbose=0), loss(labels, expected), rtol=1e-5)
        assert len(traced) == 4
    with vit_layers.native_attention(False):
        traced = _counting_native_attention(monkeypatch)
        model.compile(loss=loss)
        model.predict(images, verbose=0)
        assert not traced

    # A caller's own function and Keras' export trace TensorFlow ops only.
    traced = _counting_native_attention(monkeypatch)
    tf.function(lambda x: model(x, training=False))(images)
    model.export(str(tmp_path / "exported"), verbose=False)
    assert not traced
    np.save(tmp_path / "images.npy", images)
    script = (
        "import sys, numpy as np, tensorflow as tf\n"
        "loaded = tf.saved_model.load(sys.argv[1])\n"
        "served = loaded.serve(np.load(sys.argv[2]))\n"
        "assert 'keras_vit' not in sys.modules\n"
        "np.save(sys.argv[3], served.numpy())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *(str(tmp_path / name) for name in ("exported", "images.npy", "served.npy"))],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    served = np.load(tmp_path / "served.npy")
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-7)


@pytest.fixture
def fresh_library_lookup():
    """attention_ops() forgets its result before and after the test."""
    native.attention_ops.cache_clear()
    yield
    native.attention_ops.cache_clear()


def test_without_a_working_compiler_the_layers_fall_back_to_tensorflow_ops(
    monkeypatch, tmp_path, caplog, fresh_library_lookup
):
    monkeypatch.setenv("KERAS_VIT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(native.BuildError, match=r"`false .*attention_ops\.cc.*` failed with exit code 1"):
        native.build()
    # Remembered: later calls (other processes) report the failure without compiling again.
    with pytest.raises(native.BuildError, match=r"(?s)An earlier build failed.*attention_ops\.cc"):
        native.build()
    with pytest.raises(native.BuildError, match=r"^`false .*attention_ops\.cc"):
        native.build(force=True)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.attention_ops() is None
    assert "native attention kernels are not available" in caplog.text
    block = _random_block(6)[0]
    types = _op_types(block)
    assert "KerasVitAttention" not in types and "BatchMatMulV2" in types
    assert not list(tmp_path.glob("native/*/*.so"))  # Nothing half-built left to load.


def test_native_kernels_can_be_turned_off(monkeypatch, fresh_library_lookup):
    monkeypatch.setenv("KERAS_VIT_NATIVE", "0")
    assert native.attention_ops() is None


def test_build_flags_follow_the_cpu():
    assert "-mavx512f" in native._arch_flags({"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma", "avx2"})
    assert native._arch_flags({"avx2", "fma"}) == ["-mavx2", "-mfma"]
    assert native._arch_flags(set()) == []
