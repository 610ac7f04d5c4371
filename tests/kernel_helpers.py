"""What the kernels' tests share (tests/test_kernels_*.py): the markers for TensorFlow's forms, seeded random
arrays, traced outputs, gradients and op types, and attention written out in NumPy."""

import keras
import numpy as np
import pytest

tensorflow_only = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow forms")


# TensorFlow turns oneDNN on by default only on some CPUs: the tests of the forms it selects run here and again
# in the onednn_on child (TF_ENABLE_ONEDNN_OPTS=1), where it is on whatever the CPU (the slow one of them only
# there where it is on here too: the same run twice).
HERE_AND_WITH_ONEDNN = pytest.mark.parametrize(
    "process", ["here", pytest.param("with_onednn", marks=pytest.mark.environment("onednn_on"))]
)


def seeded(seed):
    return np.random.default_rng(seed)


def traced_output_and_gradients(function, inputs, upstream, jit_compile):
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


def graph_op_types(graph):
    types = [op.type for op in graph.get_operations()]
    for function_def in graph.as_graph_def().library.function:  # Nested functions (custom gradients).
        types += [node.op for node in function_def.node_def]
    return types


def traced_op_types(function, *specs):
    return graph_op_types(function.get_concrete_function(*specs).graph)


def explicit_attention(qkv, heads, causal=False, scale=True):
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


def explicit_cross_attention(query, key_value, heads):
    """softmax(q k^T / sqrt(head_dim)) v in float64: query (batch, queries, hidden), key_value
    (batch, tokens, 2, hidden) -> (batch, queries, hidden)."""
    batch, queries, hidden = query.shape
    q = query.reshape(batch, queries, heads, -1).astype("float64")
    k, v = (key_value[:, :, i].reshape(batch, key_value.shape[1], heads, -1).astype("float64") for i in range(2))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, queries, hidden)
