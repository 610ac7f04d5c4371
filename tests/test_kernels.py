"""keras_vit.kernels: each fast form against its reference form, and which form runs where."""

import json
import pathlib
import re

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import kernels
from keras_vit.kernels import policy, reference

tensorflow_only = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow forms")
# TensorFlow turns oneDNN on by default only on some CPUs: the tests of the forms it selects run here and again
# in the onednn_on child (TF_ENABLE_ONEDNN_OPTS=1), where it is on whatever the CPU (the slow one of them only
# there where it is on here too: the same run twice).
HERE_AND_WITH_ONEDNN = pytest.mark.parametrize(
    "process", ["here", pytest.param("with_onednn", marks=pytest.mark.environment("onednn_on"))]
)


def _rng(seed):
    return np.random.default_rng(seed)


def _traced_output_and_gradients(function, inputs, upstream, jit_compile):
    """[function(*inputs), then the gradients of <function(*inputs), upstream> with respect to
    each input], computed in a tf.function with `jit_compile`."""
    import tensorflow as tf

    @tf.function(jit_compile=jit_compile)
    def run(*inputs):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y = function(*inputs)
        return [y, *tape.gradient(y, list(inputs), output_gradients=upstream)]

    return [t.numpy() for t in run(*[tf.constant(x) for x in inputs])]


def _graph_op_types(graph):
    types = [op.type for op in graph.get_operations()]
    for function_def in graph.as_graph_def().library.function:  # Nested functions (custom gradients).
        types += [node.op for node in function_def.node_def]
    return types


def _op_types(function, *specs):
    return _graph_op_types(function.get_concrete_function(*specs).graph)


# === The layers hold no platform code ===


def test_the_layers_hold_no_backend_or_device_specific_code():
    layers = pathlib.Path(kernels.__file__).parents[1] / "layers"
    sources = {path.name: path.read_text() for path in layers.glob("*.py")}
    assert {"attention.py", "embedding.py", "encoder.py"} <= set(sources)
    forbidden = r"import tensorflow|\btf\.|keras\.src|tensorflow\.python|backend\.backend\(\)|\bjax\b|\btorch\b|device"
    for name, text in sources.items():
        assert not re.search(forbidden, text), (name, re.search(forbidden, text).group(0))


def test_the_kernels_keep_no_module_level_state():
    """Nothing in `keras_vit.kernels` is remembered between traces: no module holds a mutable
    container or a function cache; the switches are context variables, set and restored by
    `portable_ops()`, `fused_attention()` and `cpu_serving()`."""
    import contextvars
    import importlib

    names = ["keras_vit.kernels", "keras_vit.kernels.policy", "keras_vit.kernels.reference", "keras_vit.kernels.fused"]
    if keras.backend.backend() == "tensorflow":
        names += ["keras_vit.kernels.tf_cpu", "keras_vit.kernels.tf_ops"]
    context_variables = []
    for name in names:
        for key, value in vars(importlib.import_module(name)).items():
            if key.startswith("__"):
                continue
            assert not isinstance(value, (set, dict, list, bytearray)), f"{name}.{key}"
            assert not hasattr(value, "cache_info"), f"{name}.{key} is a cached function"
            if isinstance(value, contextvars.ContextVar):
                context_variables.append(f"{name}.{key}")
    assert context_variables == [
        "keras_vit.kernels.policy._PORTABLE", "keras_vit.kernels.policy._FUSED_ATTENTION",
        "keras_vit.kernels.policy._CPU_SERVING",
    ]  # fmt: skip


# === Reference forms against NumPy ===


def test_reference_attention_is_the_papers_formula():
    batch, tokens, heads, head_dim = 2, 7, 3, 4
    hidden = heads * head_dim
    qkv = _rng(0).normal(size=(batch, tokens, 3 * hidden)).astype("float32")
    attended, probabilities = reference.attention(qkv, heads)
    q, k, v = (qkv[..., i * hidden : (i + 1) * hidden].reshape(batch, tokens, heads, head_dim) for i in range(3))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, tokens, hidden)
    np.testing.assert_allclose(np.asarray(probabilities), weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(attended), expected, rtol=1e-5, atol=1e-5)


def test_reference_layer_norm_dense_and_gelu():
    rng = _rng(1)
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
    rng = _rng(10)
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


def test_attention_takes_the_stacked_and_the_flat_projections():
    """(batch, tokens, 3, hidden), the layer's layout, and (batch, tokens, 3 * hidden) are the same
    numbers; every form gives the same values for both. Other shapes are refused."""
    stacked = _rng(11).normal(size=(4, 7, 3, 12)).astype("float32")
    flat = stacked.reshape(4, 7, 36)
    want = keras.ops.convert_to_numpy(reference.attention(flat, 3)[0])
    forms = {"reference": lambda x: reference.attention(x, 3)[0]}
    if keras.backend.backend() == "tensorflow":
        from keras_vit.kernels import tf_cpu

        forms["tf_cpu training"] = lambda x: tf_cpu.attention_for_training(x, 3)
        forms["tf_cpu inference"] = lambda x: tf_cpu.attention_for_inference(x, 3)
    from keras_vit.kernels import fused

    forms["fused"] = lambda x: fused.attention(x, 3)
    forms["entry point"] = lambda x: kernels.attention(x, 3)
    for name, form in forms.items():
        for qkv in (stacked, flat):
            got = keras.ops.convert_to_numpy(form(qkv))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} {qkv.shape}")
    for bad, message in (
        (np.zeros((2, 5, 4, 12), "float32"), r"\(batch, tokens, 3, hidden\).*qkv.shape=\(2, 5, 4, 12\)"),
        (np.zeros((2, 5, 35), "float32"), r"qkv.shape=\(2, 5, 35\)"),
        (np.zeros((2, 5, 3, 10), "float32"), r"divisible by `num_heads`.*\(hidden 10\), num_heads=3"),
    ):
        with pytest.raises(ValueError, match=message):
            kernels.attention(bad, 3)


# === Fast forms against the reference forms ===


@tensorflow_only
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_tensorflow_dense_matches_the_reference(dtype, tolerance):
    from keras_vit.kernels import tf_ops

    rng = _rng(2)
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

    rng = _rng(3)
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


@tensorflow_only
@pytest.mark.parametrize("jit_compile", [True, False])
def test_cpu_training_layer_norm_matches_the_reference_and_its_gradients(jit_compile):
    from keras_vit.kernels import tf_cpu

    rng = _rng(4)
    x = rng.normal(2.0, 3.0, (3, 7, 40)).astype("float32")
    gamma, beta = rng.normal(1.0, 0.5, 40).astype("float32"), rng.normal(0.0, 0.5, 40).astype("float32")
    upstream = rng.normal(size=(3, 7, 40)).astype("float32")
    got = _traced_output_and_gradients(
        lambda x, g, b: tf_cpu.layer_norm_for_training(x, g, b, 1e-6), [x, gamma, beta], upstream, jit_compile
    )
    want = _traced_output_and_gradients(
        lambda x, g, b: reference.layer_norm(x, g, b, 1e-6), [x, gamma, beta], upstream, jit_compile
    )
    for name, g, w in zip(("output", "input", "gamma", "beta"), got, want):
        assert np.abs(w).max() > 0.1, name  # Values that could differ.
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)


@tensorflow_only
@pytest.mark.parametrize("batch, jit_compile", [(4, True), (4, False), (3, True)])
def test_cpu_training_attention_matches_the_reference_and_its_gradients(batch, jit_compile):
    """Halves of an even batch, the gradient written out; logits in the hundreds, where an
    unshifted exp would overflow."""
    from keras_vit.kernels import tf_cpu

    rng = _rng(5)
    qkv = rng.normal(size=(batch, 11, 3 * 12)).astype("float32")
    qkv[..., :12] *= 30.0
    upstream = rng.normal(size=(batch, 11, 12)).astype("float32")
    got = _traced_output_and_gradients(lambda x: tf_cpu.attention_for_training(x, 3), [qkv], upstream, jit_compile)
    want = _traced_output_and_gradients(lambda x: reference.attention(x, 3)[0], [qkv], upstream, jit_compile)
    assert np.isfinite(got[0]).all() and np.abs(want[1]).max() > 0.1
    for name, g, w in zip(("output", "qkv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)


@tensorflow_only
def test_cpu_attention_forms_trace_what_they_promise():
    import tensorflow as tf

    from keras_vit.kernels import tf_cpu

    def op_types(function, batch, dtype=tf.float32):
        return _op_types(tf.function(function), tf.TensorSpec((batch, 5, 18), dtype))

    def training(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf_cpu.attention_for_training(x, 3)
        return tape.gradient(y, x)

    # Two halves of an even static batch, one piece otherwise; no Softmax (the gradient is written out).
    assert op_types(training, 4).count("BatchMatMulV2") >= 2 * op_types(training, 3).count("BatchMatMulV2")
    assert "Softmax" not in op_types(training, 4)
    assert op_types(training, None).count("Split") == 0
    # With dropout: the reference form in each half.
    dropout = keras.layers.Dropout(0.5, seed=0)
    assert "Softmax" in op_types(lambda x: tf_cpu.attention_for_training(x, 3, dropout), 4)
    # 16-bit inference (the form for oneDNN): the softmax without the two casts around it.
    fast = op_types(lambda x: tf_cpu.attention_for_inference(x, 3), 2, tf.bfloat16).count("Cast")
    plain = op_types(lambda x: reference.attention(x, 3)[0], 2, tf.bfloat16).count("Cast")
    assert fast == plain - 2, (fast, plain)


@tensorflow_only
def test_cpu_bfloat16_inference_attention_matches_the_reference():
    import tensorflow as tf

    from keras_vit.kernels import tf_cpu

    qkv = tf.cast(_rng(6).normal(size=(2, 13, 3 * 16)), tf.bfloat16)
    got = tf.cast(tf_cpu.attention_for_inference(qkv, 4), tf.float32).numpy()
    want = tf.cast(reference.attention(qkv, 4)[0], tf.float32).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_fused_attention_matches_the_reference(monkeypatch):
    """`keras.ops.dot_product_attention` (the form for GPUs and TPUs off TensorFlow), forced here,
    gives the reference form's numbers; training asks for no flash kernel."""
    from keras_vit.kernels import fused

    calls = []
    dot_product_attention = keras.ops.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("flash_attention"))
        return dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(fused.ops, "dot_product_attention", spy)
    qkv = _rng(7).normal(size=(2, 11, 3 * 24)).astype("float32")
    want = keras.ops.convert_to_numpy(reference.attention(qkv, 3)[0])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(fused.attention(qkv, 3)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(fused.attention(qkv, 3, training=True)), want, rtol=1e-5, atol=1e-5
    )
    assert calls == [None, False]

    # The entry point: forced on, it is used unless probabilities or dropout are asked for.
    calls.clear()
    dropout = keras.layers.Dropout(0.5, seed=0)
    with kernels.fused_attention(True):
        kernels.attention(qkv, 3)
        kernels.attention(qkv, 3, return_probabilities=True)
        kernels.attention(qkv, 3, training=True, dropout=dropout)
        kernels.attention(qkv, 3, training=False, dropout=dropout)  # Dropout is off in inference.
    with kernels.fused_attention(False):
        kernels.attention(qkv, 3)
    assert calls == [None, None]


def _explicit_cross_attention(query, key_value, heads):
    """softmax(q k^T / sqrt(head_dim)) v in float64: query (batch, queries, hidden), key_value
    (batch, tokens, 2, hidden) -> (batch, queries, hidden)."""
    batch, queries, hidden = query.shape
    q = query.reshape(batch, queries, heads, -1).astype("float64")
    k, v = (key_value[:, :, i].reshape(batch, key_value.shape[1], heads, -1).astype("float64") for i in range(2))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, queries, hidden)


@pytest.mark.parametrize("queries", [1, 3])
def test_cross_attention_forms_match_the_papers_formula(monkeypatch, queries):
    """The MAP head's attention: the reference form and the fused form
    (`keras.ops.dot_product_attention`, the form for GPUs and TPUs off TensorFlow) give
    softmax(q k^T / sqrt(head_dim)) v of float64 NumPy within 1e-5, for one query token (the
    probe) and several; the entry point runs the reference form here and the fused one when
    asked, training asking Keras for no flash kernel; other shapes are refused."""
    from keras_vit.kernels import fused

    calls = []
    dot_product_attention = keras.ops.dot_product_attention

    def spy(*args, **kwargs):
        calls.append((tuple(args[0].shape), tuple(args[1].shape), kwargs.get("flash_attention")))
        return dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(fused.ops, "dot_product_attention", spy)
    rng = _rng(12)
    query = rng.normal(size=(2, queries, 12)).astype("float32")
    key_value = rng.normal(size=(2, 17, 2, 12)).astype("float32")
    key_value[:, :, 0] *= 5.0  # Peaked probabilities: a wrong scale or mask shows.
    want = _explicit_cross_attention(query, key_value, 3)
    forms = {
        "reference": lambda: reference.cross_attention(query, key_value, 3),
        "fused": lambda: fused.cross_attention(query, key_value, 3),
        "fused training": lambda: fused.cross_attention(query, key_value, 3, training=True),
        "entry point": lambda: kernels.cross_attention(query, key_value, 3),
    }
    for name, form in forms.items():
        got = keras.ops.convert_to_numpy(form())
        assert got.shape == (2, queries, 12), name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    shapes = ((2, queries, 3, 4), (2, 17, 3, 4))
    assert calls == [(*shapes, None), (*shapes, False)]  # The entry point ran the reference form.

    calls.clear()
    with kernels.fused_attention(True):
        kernels.cross_attention(query, key_value, 3)
        kernels.cross_attention(query, key_value, 3, training=True)
    with kernels.fused_attention(False):
        kernels.cross_attention(query, key_value, 3)
    with kernels.portable_ops():
        kernels.cross_attention(query, key_value, 3)
    assert calls == [(*shapes, None), (*shapes, False)]

    for bad_query, bad_key_value, message in (
        (query, key_value.reshape(2, 17, 24), r"key_value.shape=\(2, 17, 24\)"),
        (query, key_value[..., :8], r"`key_value` \(batch, tokens, 2, hidden\).*key_value.shape=\(2, 17, 2, 8\)"),
        (query[:, 0], key_value, r"query.shape=\(2, 12\)"),
        (query[..., :10], key_value[..., :10], r"divisible by `num_heads`.*num_heads=3"),
    ):
        with pytest.raises(ValueError, match=message):
            kernels.cross_attention(bad_query, bad_key_value, 3)


@tensorflow_only
def test_fused_cross_attention_has_the_reference_gradients():
    """Training-mode gradients of the fused cross-attention against the reference form's, with
    respect to queries, keys and values."""
    from keras_vit.kernels import fused

    rng = _rng(13)
    query = rng.normal(size=(2, 1, 12)).astype("float32")
    key_value = rng.normal(size=(2, 17, 2, 12)).astype("float32")
    upstream = rng.normal(size=(2, 1, 12)).astype("float32")
    got = _traced_output_and_gradients(
        lambda q, kv: fused.cross_attention(q, kv, 3, training=True), [query, key_value], upstream, False
    )
    want = _traced_output_and_gradients(
        lambda q, kv: reference.cross_attention(q, kv, 3), [query, key_value], upstream, False
    )
    for name, g, w in zip(("output", "query", "key_value"), got, want):
        assert np.abs(w).max() > 0.1, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


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
@pytest.mark.parametrize("onednn", [True, False])
def test_each_cpu_form_is_chosen_where_the_table_says(monkeypatch, onednn, process):
    """The entry points' choices on TensorFlow on a CPU, with and without oneDNN."""
    import tensorflow as tf

    from keras_vit import compat

    monkeypatch.setattr(compat, "onednn_enabled", lambda: onednn)
    gamma, beta = np.ones(8, "float32"), np.zeros(8, "float32")

    def layer_norm_ops(training, dtype):
        spec = tf.TensorSpec((2, 5, 8), dtype)
        return _op_types(tf.function(lambda x: kernels.layer_norm(x, gamma, beta, 1e-6, training=training)), spec)

    inference = layer_norm_ops(False, tf.float32)
    assert ("FusedBatchNormV3" in inference) == onednn and "MatMul" not in inference, inference
    assert layer_norm_ops(True, tf.float32).count("MatMul") == 2  # Channel means as matmuls.
    assert not {"FusedBatchNormV3", "MatMul"} & set(layer_norm_ops(True, tf.bfloat16))  # The reference form.
    assert ("FusedBatchNormV3" in layer_norm_ops(False, tf.bfloat16)) == onednn
    with kernels.portable_ops():
        portable = layer_norm_ops(False, tf.float32) + layer_norm_ops(True, tf.float32)
        assert not {"FusedBatchNormV3", "MatMul"} & set(portable)

    def attention_ops(training, dtype, batch=4):
        spec = tf.TensorSpec((batch, 5, 24), dtype)
        return _op_types(tf.function(lambda x: kernels.attention(x, 2, training=training)), spec)

    assert "Softmax" not in attention_ops(True, tf.float32) and "Split" in attention_ops(True, tf.float32)
    assert "Split" in attention_ops(True, tf.bfloat16) and "Softmax" in attention_ops(True, tf.bfloat16)
    assert "Split" not in attention_ops(False, tf.float32)
    reference_casts = _op_types(
        tf.function(lambda x: reference.attention(x, 2)[0]), tf.TensorSpec((4, 5, 24), tf.bfloat16)
    )
    assert attention_ops(False, tf.bfloat16).count("Cast") == reference_casts.count("Cast") - 2 * onednn
    with kernels.portable_ops():
        assert "Split" not in attention_ops(True, tf.float32) and "Softmax" in attention_ops(True, tf.float32)


def attention_under_a_simulated_tpu(out_dir):
    """Run by the test below (Keras' JAX backend, in its child): attention at 197 and 256 tokens where
    JAX's first device reports itself a TPU, with Splash (a Pallas TPU kernel) interpreted on
    the CPU, through keras_vit's entry point and through Keras' own route."""
    import json
    import math
    import pathlib

    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel

    from keras_vit.kernels import fused

    heads, head_dim = 2, 64
    built, flags, results = [], [], {}
    make_splash_mha = splash_attention_kernel.make_splash_mha
    dot_product_attention = fused.ops.dot_product_attention
    devices, default_backend = jax.devices, jax.default_backend

    def interpreted_splash(*args, **kwargs):
        kernel = make_splash_mha(*args, **{**kwargs, "interpret": True})  # Pallas' interpreter runs on any device.
        built.append(kernel)
        return kernel

    def spy(*args, **kwargs):
        flags.append(kwargs.get("flash_attention"))
        return dot_product_attention(*args, **kwargs)

    class SimulatedTPU:
        platform, id, device_kind = "tpu", 0, "TPU (simulated)"

    splash_attention_kernel.make_splash_mha = interpreted_splash
    fused.ops.dot_product_attention = spy
    # What Keras reads (jax.devices()[0].platform) and what keras_vit's policy reads.
    jax.devices = lambda backend=None: [SimulatedTPU()] if backend is None else devices(backend)
    jax.default_backend = lambda: "tpu"
    try:
        assert kernels.current().device == "tpu" and kernels.current().use_fused_attention
        for tokens in (197, 256):
            qkv = _rng(tokens).normal(size=(1, tokens, 3, heads * head_dim)).astype("float32")
            q, k, v = (qkv[:, :, i].reshape(1, tokens, heads, head_dim) for i in range(3))
            built.clear(), flags.clear()
            guarded = keras.ops.convert_to_numpy(kernels.attention(qkv, heads))
            guarded_flags, guarded_built = list(flags), len(built)
            built.clear()
            unguarded = keras.ops.convert_to_numpy(
                keras.ops.dot_product_attention(q, k, v, scale=1.0 / math.sqrt(head_dim))
            )
            results[tokens] = {
                "guarded": guarded.reshape(1, tokens, heads, head_dim).tolist(),
                "guarded_flags": guarded_flags,
                "guarded_splash_kernels": guarded_built,
                "unguarded": unguarded.tolist(),
                "unguarded_splash_kernels": len(built),
                "qkv": qkv.tolist(),
            }
        # The MAP head's cross-attention: one query against 256 tokens, guarded too.
        query = _rng(1).normal(size=(1, 1, heads * head_dim)).astype("float32")
        key_value = _rng(2).normal(size=(1, 256, 2, heads * head_dim)).astype("float32")
        built.clear(), flags.clear()
        attended = keras.ops.convert_to_numpy(kernels.cross_attention(query, key_value, heads))
        results["cross"] = {
            "flags": list(flags),
            "splash_kernels": len(built),
            "error": float(np.abs(attended - _explicit_cross_attention(query, key_value, heads)).max()),
        }
    finally:
        splash_attention_kernel.make_splash_mha = make_splash_mha
        fused.ops.dot_product_attention = dot_product_attention
        jax.devices, jax.default_backend = devices, default_backend
    (pathlib.Path(out_dir) / "result.json").write_text(json.dumps(results))


def _explicit_attention(qkv, heads, causal=False, scale=True):
    """softmax(q k^T / sqrt(head_dim)) v in float64, (batch, tokens, heads, head_dim); optionally
    with a causal mask or without the scale."""
    batch, tokens = qkv.shape[:2]
    q, k, v = (qkv[:, :, i].reshape(batch, tokens, heads, -1).astype("float64") for i in range(3))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / (np.sqrt(q.shape[-1]) if scale else 1.0)
    if causal:
        logits = np.where(np.tril(np.ones((tokens, tokens), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v)


@pytest.mark.slow
@pytest.mark.environment("jax_without_tensorflow")
def test_attention_on_a_tpu_never_takes_keras_splash_route(tmp_path):
    """On a (simulated) TPU keras_vit's attention is softmax(q k^T / sqrt(d)) v at 197 and 256
    tokens and asks Keras for no flash kernel; Keras' own route, the same call with
    flash_attention=None, runs Splash at 256 tokens (a multiple of its 128-row blocks) with a
    causal mask and no scaling: the function the guard in keras_vit/kernels/fused.py keeps out.
    The MAP head's cross-attention is guarded the same way. Float32 against float64: 1e-5."""
    attention_under_a_simulated_tpu(tmp_path)
    results = json.loads((tmp_path / "result.json").read_text())
    for tokens in ("197", "256"):
        result = results[tokens]
        qkv = np.asarray(result["qkv"], "float32")
        want = _explicit_attention(qkv, 2)
        np.testing.assert_allclose(np.asarray(result["guarded"]), want, rtol=1e-5, atol=1e-5, err_msg=tokens)
    for tokens in ("197", "256"):
        result = results[tokens]
        assert result["guarded_flags"] == [False] and result["guarded_splash_kernels"] == 0, result["guarded_flags"]
        qkv = np.asarray(result["qkv"], "float32")
        want = _explicit_attention(qkv, 2)
        unguarded = np.asarray(result["unguarded"])
        if tokens == "197":  # Splash refuses the shape; Keras falls back to the XLA formulation.
            assert result["unguarded_splash_kernels"] == 0
            np.testing.assert_allclose(unguarded, want, rtol=1e-5, atol=1e-5)
        else:
            assert result["unguarded_splash_kernels"] == 1
            # When this stops holding, Keras' route computes the right function: see fused.py.
            assert np.abs(unguarded - want).max() > 0.1
            causal_unscaled = _explicit_attention(qkv, 2, causal=True, scale=False)
            np.testing.assert_allclose(unguarded, causal_unscaled, rtol=1e-4, atol=1e-4)
    assert results["cross"]["flags"] == [False] and results["cross"]["splash_kernels"] == 0, results["cross"]
    assert results["cross"]["error"] < 1e-5


# === Which form runs where: decided per trace ===


def _fake_accelerator(monkeypatch, kind):
    """Makes TensorFlow report a logical `kind` device ("GPU" or "TPU") as the kernels read it."""
    import tensorflow as tf

    real = tf.config.list_logical_devices

    def list_logical_devices(device_type=None):
        if device_type == kind:
            return [tf.config.LogicalDevice(name=f"/device:{kind}:0", device_type=kind)]
        return real(device_type)

    monkeypatch.setattr(tf.config, "list_logical_devices", list_logical_devices)


@tensorflow_only
def test_the_target_is_read_at_every_trace(monkeypatch):
    import tensorflow as tf

    assert kernels.current() == policy.Target("tensorflow", "cpu")
    assert kernels.current().tensorflow_cpu and not kernels.current().use_fused_attention
    with kernels.portable_ops():
        assert kernels.current().portable and not kernels.current().tensorflow_cpu
        with kernels.fused_attention(True):
            assert kernels.current().use_fused_attention
    assert not kernels.current().portable
    # A strategy's devices: two logical CPUs are a CPU.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        assert kernels.current().device == "cpu"
    for kind in ("GPU", "TPU"):
        with monkeypatch.context() as patch:
            _fake_accelerator(patch, kind)
            assert kernels.current().device == kind.lower() and not kernels.current().tensorflow_cpu
    assert kernels.current().device == "cpu"  # Nothing remembered.
    assert policy.device_kind(["/job:worker/replica:0/task:1/device:TPU:3"]) == "tpu"
    assert policy.device_kind(["cuda:0"]) == policy.device_kind(["gpu:1"]) == "gpu"
    assert policy.device_kind(["cpu:0", "/device:CPU:1"]) == "cpu"


def test_the_splash_guard_asks_the_policy(monkeypatch):
    """Keras' Splash route is kept off on JAX wherever the policy targets a TPU or JAX's default
    backend (what Keras reads) is one; never on other backends."""
    from keras_vit.kernels import fused

    for backend, target, default, want in (
        ("jax", "cpu", "cpu", False),
        ("jax", "gpu", "gpu", False),
        ("jax", "tpu", "tpu", True),
        ("jax", "cpu", "tpu", True),  # A keras.distribution over CPUs on a TPU machine.
        ("jax", "tpu", "cpu", True),
        ("torch", "tpu", "tpu", False),
    ):
        monkeypatch.setattr(policy, "current", lambda b=backend, t=target: policy.Target(b, t))
        monkeypatch.setattr(policy, "default_device", lambda backend=None, d=default: d)
        assert fused.keeps_off_keras_splash() is want, (backend, target, default)


def _small_model():
    import keras_vit

    model = keras_vit.build_vit(
        "testing", image_size=16, num_classes=5, num_layers=2, dropout_rate=0.1, classifier="token"
    )
    # Learning rate 0: fit steps leave the weights as they are, so predictions can be compared.
    model.compile(keras.optimizers.SGD(0.0), loss="sparse_categorical_crossentropy", jit_compile=True)
    return model


def _traced_ops(run):
    """The op types of every graph in which `run()` traces a kernel entry point."""
    import tensorflow as tf

    graphs = []
    current = policy.current

    def recording_current():
        graph = tf.compat.v1.get_default_graph()
        if graph not in graphs:
            graphs.append(graph)
        return current()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy, "current", recording_current)
        run()
    return [op for graph in graphs for op in _graph_op_types(graph)]


@tensorflow_only
@pytest.mark.slow
@HERE_AND_WITH_ONEDNN
def test_a_model_traced_on_a_cpu_then_for_an_accelerator_gets_no_cpu_forms(monkeypatch, process):
    """Keras' predict and a fit step, traced for the CPU (after an eager call), then traced again
    for a (simulated) GPU: the first graphs carry the CPU forms, the second none of them. Where oneDNN
    is on here already (TensorFlow's default on some CPUs), the with_onednn run is this run: it runs
    there only."""
    from keras_vit import compat

    if process == "here" and compat.onednn_enabled():
        pytest.skip("oneDNN is on here, as in the onednn_on child: this run is the with_onednn one, which runs it")
    model = _small_model()
    images = _rng(8).integers(0, 256, (4, 16, 16, 3)).astype("float32")
    labels = np.arange(4) % 5
    model(images)  # An eager call first.

    def predict():
        return model.predict(images, batch_size=4, verbose=0)

    def fit():
        model.fit(images, labels, batch_size=4, epochs=1, verbose=0)

    def traced_for(kind):
        with monkeypatch.context() as patch:
            if kind:
                _fake_accelerator(patch, kind)
            model.make_predict_function(force=True)
            model.make_train_function(force=True)
            predictions = []
            predict_ops = _traced_ops(lambda: predictions.append(predict()))
            fit_ops = _traced_ops(fit)
        return predict_ops, predictions[0], fit_ops

    cpu_predict_ops, cpu_predictions, cpu_fit_ops = traced_for(None)
    gpu_predict_ops, gpu_predictions, gpu_fit_ops = traced_for("GPU")
    cpu_again = traced_for(None)

    # The CPU forms: oneDNN's layer norm subgraph (where TensorFlow has oneDNN) in predict; in the
    # XLA-compiled fit step the layer norms' channel means as matmuls, the attention's written-out
    # gradient (no Softmax) in two halves of the batch.
    assert ("FusedBatchNormV3" in cpu_predict_ops) == compat.onednn_enabled()
    assert "Softmax" in cpu_predict_ops
    assert "FusedBatchNormV3" not in cpu_fit_ops and "Softmax" not in cpu_fit_ops
    assert cpu_fit_ops.count("Split") >= 2

    cpu_only = {"FusedBatchNormV3", "PlaceholderWithDefault", "Split"}
    assert not cpu_only & set(gpu_predict_ops), sorted(cpu_only & set(gpu_predict_ops))
    assert not cpu_only & set(gpu_fit_ops), sorted(cpu_only & set(gpu_fit_ops))
    assert "Softmax" in gpu_fit_ops and gpu_fit_ops.count("Mean") > cpu_fit_ops.count("Mean")
    # And back on the CPU, its forms again: nothing was remembered.
    assert sorted(cpu_again[0]) == sorted(cpu_predict_ops) and sorted(cpu_again[2]) == sorted(cpu_fit_ops)
    # No op outside TensorFlow's own: a custom op would not be in tf.raw_ops.
    import tensorflow as tf

    unknown = {t for t in gpu_predict_ops + gpu_fit_ops if not hasattr(tf.raw_ops, t)}
    assert not unknown, unknown
    # Other forms, same numbers (the "GPU" graphs still run on this CPU).
    np.testing.assert_allclose(gpu_predictions, cpu_predictions, rtol=1e-4, atol=1e-5)


@tensorflow_only
def test_the_name_of_the_calling_function_does_not_choose_the_kernels():
    """A caller's function named like one of Keras' trainer functions traces what any other does."""
    import tensorflow as tf

    import keras_vit

    model = keras_vit.build_vit("testing", image_size=16, num_classes=5, num_layers=1)
    spec = tf.TensorSpec((2, 16, 16, 3))

    def one_step_on_data(x):
        return model(x, training=False)

    def serve(x):
        return model(x, training=False)

    same_name, other_name = (sorted(_op_types(tf.function(f), spec)) for f in (one_step_on_data, serve))
    assert same_name == other_name
    assert all(hasattr(tf.raw_ops, op) for op in same_name), sorted(set(same_name))


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
        weight.assign(_rng(9).normal(0.0, 0.2, weight.shape))
    ops = [op for op, _ in traced_op_times(lambda x: block(x), np.ones((2, 9, 16), "float32"))]
    fused = "_MklNativeFusedMatMul" if compat.onednn_enabled() else "_FusedMatMul"
    assert ops.count(fused) == 4 and "BiasAdd" not in ops, ops  # QKV, attention output, MLP 1 and 2.
    if compat.onednn_enabled():
        assert "Erf" not in ops and ops.count("_MklLayerNorm") == 2, ops


# === cuDNN attention on padded tokens (JAX on an NVIDIA GPU) ===


def _explicit_attention_gradients(query, key, value, upstream):
    """The gradients of <softmax(q k^T / sqrt(head_dim)) v, upstream> with respect to q, k and v,
    (batch, tokens, heads, head_dim) each, in float64 from the closed form: dV = P^T dO,
    dS = P * (dO V^T - rowsum(dO V^T * P)), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d)."""
    q, k, v, up = (np.asarray(x, "float64") for x in (query, key, value, upstream))
    scale = 1.0 / np.sqrt(q.shape[-1])
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d_p = np.einsum("bqhd,bkhd->bhqk", up, v)
    d_logits = p * (d_p - (d_p * p).sum(-1, keepdims=True)) * scale
    return (
        np.einsum("bhqk,bkhd->bqhd", d_logits, k),
        np.einsum("bhqk,bqhd->bkhd", d_logits, q),
        np.einsum("bhqk,bqhd->bkhd", p, up),
    )


@pytest.mark.parametrize("queries, tokens, multiple", [(197, 197, 64), (1, 197, 64), (3, 16, 8)])
def test_padded_attention_is_the_unpadded_attention_with_its_gradients(queries, tokens, multiple):
    """Tokens padded with zeros, padded keys masked by length, padded queries dropped: the same
    outputs and gradients with respect to queries, keys and values as attention over the tokens
    alone (float64 NumPy, the gradients' closed form, within 1e-5); run with JAX's XLA
    implementation, the reference behind the cuDNN call on a GPU. Self-attention at 197 tokens,
    the MAP head's one query attending to 197 tokens, and keys already a multiple of 8 (only the
    queries padded)."""
    import jax
    import jax.numpy as jnp

    from keras_vit.kernels import fused

    heads, head_dim = 2, 16
    rng = _rng(tokens + queries)
    query_array = rng.normal(size=(2, queries, heads * head_dim)).astype("float32")
    key_value = rng.normal(size=(2, tokens, 2, heads * head_dim)).astype("float32")
    upstream = rng.normal(size=(2, queries, heads, head_dim)).astype("float32")
    query = query_array.reshape(2, queries, heads, head_dim)
    key, value = (key_value[:, :, i].reshape(2, tokens, heads, head_dim) for i in range(2))

    def padded(q, k, v):
        return fused.padded_attention(q, k, v, 1.0 / np.sqrt(head_dim), "xla", multiple)

    @jax.jit
    def output_and_gradients(q, k, v):
        out, backward = jax.vjp(padded, q, k, v)
        return out, backward(jnp.asarray(upstream))

    got, got_gradients = output_and_gradients(query, key, value)
    want = _explicit_cross_attention(query_array, key_value, heads).reshape(got.shape)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    for name, g, w in zip("qkv", got_gradients, _explicit_attention_gradients(query, key, value, upstream)):
        assert np.abs(w).max() > 0.05, name  # Gradients that could differ (one query's spread over 197 keys).
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=name)

    # bfloat16, as it runs on a GPU: within bfloat16's rounding of the float64 result.
    bf16 = np.asarray(jax.jit(padded)(*(jnp.asarray(x, jnp.bfloat16) for x in (query, key, value))), "float32")
    np.testing.assert_allclose(bf16, want, rtol=2e-2, atol=2e-2)


def attention_under_a_simulated_gpu(out_dir):
    """Run by the test below (Keras' JAX backend on the CPU, in its child, JAX's default backend
    reported as "gpu"): which attention call each case makes, with JAX's cuDNN calls run by its XLA
    implementation; the outputs and a training step's gradients of a model with a MAP head against
    the reference form; the model's forward pass traced on the GPU, then on the CPU; and what
    happens where cuDNN is refused (the real cuDNN call on a CPU)."""
    import json
    import logging
    import pathlib

    import jax

    from keras_vit.kernels import fused

    calls, results = [], {}
    jax_attention, keras_attention = jax.nn.dot_product_attention, fused.ops.dot_product_attention

    def jax_spy(query, key, value, **kwargs):
        lengths = kwargs.get("key_value_seq_lengths")
        if kwargs.get("implementation") == "cudnn":  # Keras' route calls it too, with "xla".
            try:
                lengths = None if lengths is None else int(lengths[0])
            except jax.errors.ConcretizationTypeError:  # Traced by jax.jit: known when it runs.
                lengths = "traced"
            calls.append(["jax", "cudnn", query.shape[1], key.shape[1], lengths])
        return jax_attention(query, key, value, **{**kwargs, "implementation": "xla"})

    def keras_spy(*args, **kwargs):
        calls.append(["keras", kwargs.get("flash_attention"), args[0].shape[1], args[1].shape[1], None])
        return keras_attention(*args, **kwargs)

    default_backend = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        assert kernels.current().device == "gpu"
        jax.nn.dot_product_attention, fused.ops.dot_product_attention = jax_spy, keras_spy
        for name, tokens, hidden, dtype, training in (
            ("bfloat16 197", 197, 4 * 16, "bfloat16", False),
            ("bfloat16 197 training", 197, 4 * 16, "bfloat16", True),
            ("float16 128", 128, 4 * 16, "float16", False),
            ("float32 197", 197, 4 * 16, "float32", False),
            ("bfloat16 head_dim 12", 197, 4 * 12, "bfloat16", False),
        ):
            calls.clear()
            qkv = _rng(tokens).normal(size=(2, tokens, 3, hidden)).astype("float32")
            x = keras.ops.cast(qkv, dtype)
            got = keras.ops.convert_to_numpy(keras.ops.cast(kernels.attention(x, 4, training=training), "float32"))
            error = float(np.abs(got - _explicit_attention(qkv, 4).reshape(got.shape)).max())
            results[name] = {"calls": list(calls), "error": error}

        # The MAP head's cross-attention: one query against 197 tokens.
        query = _rng(1).normal(size=(2, 1, 64)).astype("float32")
        key_value = _rng(2).normal(size=(2, 197, 2, 64)).astype("float32")
        for dtype in ("bfloat16", "float32"):
            calls.clear()
            got = kernels.cross_attention(keras.ops.cast(query, dtype), keras.ops.cast(key_value, dtype), 4)
            got = keras.ops.convert_to_numpy(keras.ops.cast(got, "float32"))
            error = float(np.abs(got - _explicit_cross_attention(query, key_value, 4)).max())
            results[f"cross {dtype}"] = {"calls": list(calls), "error": error}

        # A model with a MAP head (16 patches, no class token), one jitted training step through
        # the fused forms (cuDNN's, run by XLA here) and through the reference forms: the same loss
        # and gradients within bfloat16 rounding.
        keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
        model = keras_vit.build_vit(
            "testing", image_size=16, patch_size=4, hidden_dim=32, num_heads=2, mlp_dim=64, num_layers=2,
            num_classes=5, classifier="map", head_kernel_initializer="glorot_uniform",
        )  # fmt: skip
        images = _rng(3).uniform(0, 255, (4, 16, 16, 3)).astype("float32")
        labels = np.arange(4) % 5

        def loss_and_gradients():
            trainable = [v.value for v in model.trainable_variables]
            fixed = [v.value for v in model.non_trainable_variables]

            def loss(trainable):
                logits, _ = model.stateless_call(trainable, fixed, images, training=True)
                return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))

            # A new function each time: traced here, within the switches in force.
            value, grads = jax.jit(jax.value_and_grad(loss))(trainable)
            return float(value), [np.asarray(g, "float32") for g in grads]

        calls.clear()
        fused_loss, fused_grads = loss_and_gradients()
        results["model calls"] = list(calls)
        calls.clear()
        with kernels.portable_ops():
            reference_loss, reference_grads = loss_and_gradients()
        results["model"] = {
            "loss": [fused_loss, reference_loss],
            "gradient error": max(
                float(np.abs(f - r).max() / (np.abs(r).max() + 1e-12)) for f, r in zip(fused_grads, reference_grads)
            ),
            "reference calls": list(calls),
        }

        # Its forward pass traced on the simulated GPU, then with the CPU as JAX's backend: the
        # fused forms, then the reference forms only, nothing remembered.
        predictions = {}
        for device in ("gpu", "cpu"):
            calls.clear()
            jax.default_backend = default_backend if device == "cpu" else (lambda: "gpu")
            predictions[device] = keras.ops.convert_to_numpy(jax.jit(lambda x: model(x))(images)).astype("float32")
            results[f"model calls on the {device}"] = list(calls)
        jax.default_backend = lambda: "gpu"
        keras.mixed_precision.set_dtype_policy("float32")
        results["model predictions"] = [predictions["gpu"].tolist(), predictions["cpu"].tolist()]

        # The real cuDNN call on a machine without cuDNN: refused, logged at debug level each time
        # (nothing remembered), XLA's formulation runs.
        jax.nn.dot_product_attention = jax_attention
        messages = []
        handler = logging.Handler()
        handler.emit = lambda record: messages.append([record.levelname, record.getMessage()])
        logger = logging.getLogger("keras_vit")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        calls.clear()
        qkv = _rng(5).normal(size=(2, 197, 3, 64)).astype("float32")
        outputs = [
            keras.ops.convert_to_numpy(keras.ops.cast(kernels.attention(keras.ops.cast(qkv, "bfloat16"), 4), "float32"))
            for _ in range(2)
        ]
        results["refused"] = {
            "messages": messages,
            "calls": list(calls),
            "error": float(np.abs(outputs[1] - _explicit_attention(qkv, 4).reshape(outputs[1].shape)).max()),
        }
    finally:
        jax.default_backend = default_backend
        jax.nn.dot_product_attention, fused.ops.dot_product_attention = jax_attention, keras_attention
    (pathlib.Path(out_dir) / "result.json").write_text(json.dumps(results))


@pytest.mark.slow
@pytest.mark.environment("jax_without_tensorflow")
def test_on_a_gpu_jax_runs_cudnn_attention_on_padded_tokens(tmp_path):
    """On a (simulated) GPU under JAX, 16-bit attention is cuDNN's on tokens padded to a multiple
    of 64 with the real count as the keys' length, for inference and training; float32 and head
    widths cuDNN refuses take Keras' route; the MAP head's cross-attention takes the same routes,
    and a model with classifier="map" runs its head through cuDNN too; the results and the model's
    training gradients match the reference form within bfloat16 rounding; traced again with the CPU
    as JAX's backend, the model runs the reference forms; where cuDNN is refused the fallback says
    so at debug level, each time."""
    attention_under_a_simulated_gpu(tmp_path)
    results = json.loads((tmp_path / "result.json").read_text())
    assert results["bfloat16 197"]["calls"] == [["jax", "cudnn", 256, 256, 197]]
    assert results["bfloat16 197 training"]["calls"] == [["jax", "cudnn", 256, 256, 197]]
    assert results["float16 128"]["calls"] == [["jax", "cudnn", 128, 128, None]]  # Already a multiple: no mask.
    assert results["float32 197"]["calls"] == [["keras", None, 197, 197, None]]
    assert results["bfloat16 head_dim 12"]["calls"] == [["keras", None, 197, 197, None]]
    assert results["cross bfloat16"]["calls"] == [["jax", "cudnn", 64, 256, 197]]  # One query, padded to 64.
    assert results["cross float32"]["calls"] == [["keras", None, 1, 197, None]]
    for name in ("bfloat16 197", "bfloat16 197 training", "float16 128", "bfloat16 head_dim 12", "cross bfloat16"):
        assert results[name]["error"] < 3e-2, (name, results[name]["error"])
    assert results["float32 197"]["error"] < 1e-5 and results["cross float32"]["error"] < 1e-5

    # The model: two blocks' self-attention and the MAP head's cross-attention, all cuDNN's, 16
    # tokens padded to 64 (the head's one query too) with 16 as the keys' length.
    assert results["model calls"] == [["jax", "cudnn", 64, 64, "traced"]] * 3, results["model calls"]
    assert results["model"]["reference calls"] == []
    fused_loss, reference_loss = results["model"]["loss"]
    assert abs(fused_loss - reference_loss) < 2e-2 * abs(reference_loss), results["model"]
    assert results["model"]["gradient error"] < 5e-2, results["model"]
    assert results["model calls on the gpu"] == [["jax", "cudnn", 64, 64, "traced"]] * 3
    assert results["model calls on the cpu"] == []
    on_gpu, on_cpu = (np.asarray(p) for p in results["model predictions"])
    np.testing.assert_allclose(on_gpu, on_cpu, rtol=3e-2, atol=3e-2 * np.abs(on_cpu).max())

    refused = results["refused"]
    assert [level for level, _ in refused["messages"]] == ["DEBUG", "DEBUG"], refused["messages"]
    assert all("cuDNN attention is not available here" in message for _, message in refused["messages"])
    assert refused["calls"] == [["keras", None, 197, 197, None]] * 2 and refused["error"] < 3e-2
