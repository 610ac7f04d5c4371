"""keras_vit.kernels' attention on padded tokens, the form for cuDNN's fused attention (JAX on an NVIDIA GPU): the
unpadded attention and its gradients, and on a simulated GPU the cuDNN route."""

import json

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import kernels
from tests.kernel_helpers import explicit_attention, explicit_cross_attention, seeded


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
    rng = seeded(tokens + queries)
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
    want = explicit_cross_attention(query_array, key_value, heads).reshape(got.shape)
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
            qkv = seeded(tokens).normal(size=(2, tokens, 3, hidden)).astype("float32")
            x = keras.ops.cast(qkv, dtype)
            got = keras.ops.convert_to_numpy(keras.ops.cast(kernels.attention(x, 4, training=training), "float32"))
            error = float(np.abs(got - explicit_attention(qkv, 4).reshape(got.shape)).max())
            results[name] = {"calls": list(calls), "error": error}

        # The MAP head's cross-attention: one query against 197 tokens.
        query = seeded(1).normal(size=(2, 1, 64)).astype("float32")
        key_value = seeded(2).normal(size=(2, 197, 2, 64)).astype("float32")
        for dtype in ("bfloat16", "float32"):
            calls.clear()
            got = kernels.cross_attention(keras.ops.cast(query, dtype), keras.ops.cast(key_value, dtype), 4)
            got = keras.ops.convert_to_numpy(keras.ops.cast(got, "float32"))
            error = float(np.abs(got - explicit_cross_attention(query, key_value, 4)).max())
            results[f"cross {dtype}"] = {"calls": list(calls), "error": error}

        # A model with a MAP head (16 patches, no class token), one jitted training step through
        # the fused forms (cuDNN's, run by XLA here) and through the reference forms: the same loss
        # and gradients within bfloat16 rounding.
        keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
        model = keras_vit.build_vit(
            "testing", image_size=16, patch_size=4, hidden_dim=32, num_heads=2, mlp_dim=64, num_layers=2,
            num_classes=5, classifier="map", head_kernel_initializer="glorot_uniform",
        )  # fmt: skip
        images = seeded(3).uniform(0, 255, (4, 16, 16, 3)).astype("float32")
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
        qkv = seeded(5).normal(size=(2, 197, 3, 64)).astype("float32")
        outputs = [
            keras.ops.convert_to_numpy(keras.ops.cast(kernels.attention(keras.ops.cast(qkv, "bfloat16"), 4), "float32"))
            for _ in range(2)
        ]
        results["refused"] = {
            "messages": messages,
            "calls": list(calls),
            "error": float(np.abs(outputs[1] - explicit_attention(qkv, 4).reshape(outputs[1].shape)).max()),
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
