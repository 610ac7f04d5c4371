"""keras_vit.kernels' attention: the reference form against the paper's formula, the CPU forms (training, 16-bit
inference) and the fused form against the reference, the MAP head's cross-attention, and a simulated TPU's."""

import json

import keras
import numpy as np
import pytest

from keras_vit import kernels
from keras_vit.kernels import reference
from tests.kernel_helpers import (
    explicit_attention,
    explicit_cross_attention,
    seeded,
    tensorflow_only,
    traced_op_types,
    traced_output_and_gradients,
)


def test_reference_attention_is_the_papers_formula():
    batch, tokens, heads, head_dim = 2, 7, 3, 4
    hidden = heads * head_dim
    qkv = seeded(0).normal(size=(batch, tokens, 3 * hidden)).astype("float32")
    attended, probabilities = reference.attention(qkv, heads)
    q, k, v = (qkv[..., i * hidden : (i + 1) * hidden].reshape(batch, tokens, heads, head_dim) for i in range(3))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, tokens, hidden)
    np.testing.assert_allclose(np.asarray(probabilities), weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(attended), expected, rtol=1e-5, atol=1e-5)


def test_attention_takes_the_stacked_and_the_flat_projections():
    """(batch, tokens, 3, hidden), the layer's layout, and (batch, tokens, 3 * hidden) are the same
    numbers; every form gives the same values for both. Other shapes are refused."""
    stacked = seeded(11).normal(size=(4, 7, 3, 12)).astype("float32")
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


@tensorflow_only
@pytest.mark.parametrize("batch, jit_compile", [(4, True), (4, False), (3, True)])
def test_cpu_training_attention_matches_the_reference_and_its_gradients(batch, jit_compile):
    """Halves of an even batch, the gradient written out; logits in the hundreds, where an
    unshifted exp would overflow."""
    from keras_vit.kernels import tf_cpu

    rng = seeded(5)
    qkv = rng.normal(size=(batch, 11, 3 * 12)).astype("float32")
    qkv[..., :12] *= 30.0
    upstream = rng.normal(size=(batch, 11, 12)).astype("float32")
    got = traced_output_and_gradients(lambda x: tf_cpu.attention_for_training(x, 3), [qkv], upstream, jit_compile)
    want = traced_output_and_gradients(lambda x: reference.attention(x, 3)[0], [qkv], upstream, jit_compile)
    assert np.isfinite(got[0]).all() and np.abs(want[1]).max() > 0.1
    for name, g, w in zip(("output", "qkv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)


@tensorflow_only
def test_cpu_attention_forms_trace_what_they_promise():
    import tensorflow as tf

    from keras_vit.kernels import tf_cpu

    def op_types(function, batch, dtype=tf.float32):
        return traced_op_types(tf.function(function), tf.TensorSpec((batch, 5, 18), dtype))

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

    qkv = tf.cast(seeded(6).normal(size=(2, 13, 3 * 16)), tf.bfloat16)
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
    qkv = seeded(7).normal(size=(2, 11, 3 * 24)).astype("float32")
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
    rng = seeded(12)
    query = rng.normal(size=(2, queries, 12)).astype("float32")
    key_value = rng.normal(size=(2, 17, 2, 12)).astype("float32")
    key_value[:, :, 0] *= 5.0  # Peaked probabilities: a wrong scale or mask shows.
    want = explicit_cross_attention(query, key_value, 3)
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

    rng = seeded(13)
    query = rng.normal(size=(2, 1, 12)).astype("float32")
    key_value = rng.normal(size=(2, 17, 2, 12)).astype("float32")
    upstream = rng.normal(size=(2, 1, 12)).astype("float32")
    got = traced_output_and_gradients(
        lambda q, kv: fused.cross_attention(q, kv, 3, training=True), [query, key_value], upstream, False
    )
    want = traced_output_and_gradients(
        lambda q, kv: reference.cross_attention(q, kv, 3), [query, key_value], upstream, False
    )
    for name, g, w in zip(("output", "query", "key_value"), got, want):
        assert np.abs(w).max() > 0.1, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


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
            qkv = seeded(tokens).normal(size=(1, tokens, 3, heads * head_dim)).astype("float32")
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
        query = seeded(1).normal(size=(1, 1, heads * head_dim)).astype("float32")
        key_value = seeded(2).normal(size=(1, 256, 2, heads * head_dim)).astype("float32")
        built.clear(), flags.clear()
        attended = keras.ops.convert_to_numpy(kernels.cross_attention(query, key_value, heads))
        results["cross"] = {
            "flags": list(flags),
            "splash_kernels": len(built),
            "error": float(np.abs(attended - explicit_cross_attention(query, key_value, heads)).max()),
        }
    finally:
        splash_attention_kernel.make_splash_mha = make_splash_mha
        fused.ops.dot_product_attention = dot_product_attention
        jax.devices, jax.default_backend = devices, default_backend
    (pathlib.Path(out_dir) / "result.json").write_text(json.dumps(results))


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
        want = explicit_attention(qkv, 2)
        np.testing.assert_allclose(np.asarray(result["guarded"]), want, rtol=1e-5, atol=1e-5, err_msg=tokens)
    for tokens in ("197", "256"):
        result = results[tokens]
        assert result["guarded_flags"] == [False] and result["guarded_splash_kernels"] == 0, result["guarded_flags"]
        qkv = np.asarray(result["qkv"], "float32")
        want = explicit_attention(qkv, 2)
        unguarded = np.asarray(result["unguarded"])
        if tokens == "197":  # Splash refuses the shape; Keras falls back to the XLA formulation.
            assert result["unguarded_splash_kernels"] == 0
            np.testing.assert_allclose(unguarded, want, rtol=1e-5, atol=1e-5)
        else:
            assert result["unguarded_splash_kernels"] == 1
            # When this stops holding, Keras' route computes the right function: see fused.py.
            assert np.abs(unguarded - want).max() > 0.1
            causal_unscaled = explicit_attention(qkv, 2, causal=True, scale=False)
            np.testing.assert_allclose(unguarded, causal_unscaled, rtol=1e-4, atol=1e-4)
    assert results["cross"]["flags"] == [False] and results["cross"]["splash_kernels"] == 0, results["cross"]
    assert results["cross"]["error"] < 1e-5
