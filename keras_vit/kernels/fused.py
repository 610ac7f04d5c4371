"""Attention as one fused kernel: the fast form on GPUs and TPUs with a backend
other than TensorFlow, for self-attention (`attention`) and the MAP head's
cross-attention (`cross_attention`) alike (`attend`).

- JAX on an NVIDIA GPU, 16-bit: cuDNN's fused (flash) attention, forward and
  backward, through `jax.nn.dot_product_attention(implementation="cudnn")` on
  the tokens padded to a multiple of `CUDNN_TOKEN_MULTIPLE`, the padded keys
  masked by length (`padded_attention`).
- Elsewhere (float32 on a GPU, TPUs, PyTorch): `keras.ops.dot_product_attention`,
  which runs JAX's XLA formulation (logits and softmax in float32, like the
  reference form) or PyTorch's `scaled_dot_product_attention`. On TPUs this
  form asks Keras for no flash kernel (`keeps_off_keras_splash`).
"""

import logging
import math

import keras
from keras import ops

from keras_vit.kernels import policy, reference

# Keras' own call did not get cuDNN's kernel for a ViT's 197 tokens on an H200
# ("Unsupported sequence length Q 197, KV 197"), and XLA's formulation is slow
# there; on the tokens padded to a multiple of 64, the row tile of cuDNN's
# kernels, with the padded keys masked by length, cuDNN runs: 197 becomes 256.
CUDNN_TOKEN_MULTIPLE = 64
# cuDNN's limits on the head width (JAX's `check_is_flash_attention`).
CUDNN_HEAD_DIM_MULTIPLE, CUDNN_MAX_HEAD_DIM = 8, 128


def attention(qkv, num_heads, training=False):
    """The reference `attention`'s attended values, without probabilities or dropout."""
    tokens = reference.dim(qkv, 1)
    hidden = reference.qkv_width(qkv)
    # (batch, tokens, heads, head_dim) is the layout the fused kernels take: no transposes.
    qkv = ops.reshape(qkv, (-1, tokens, 3, num_heads, hidden // num_heads))
    attended = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], training)
    return ops.reshape(attended, (-1, tokens, hidden))


def cross_attention(query, key_value, num_heads, training=False):
    """The reference `cross_attention`: query (batch, query tokens, hidden) attending to
    key_value (batch, tokens, 2, hidden)."""
    query_tokens, tokens, hidden = reference.dim(query, 1), reference.dim(key_value, 1), query.shape[-1]
    head_dim = hidden // num_heads
    query = ops.reshape(query, (-1, query_tokens, num_heads, head_dim))
    key_value = ops.reshape(key_value, (-1, tokens, 2, num_heads, head_dim))
    attended = attend(query, key_value[:, :, 0], key_value[:, :, 1], training)
    return ops.reshape(attended, (-1, query_tokens, hidden))


def attend(query, key, value, training=False):
    """softmax(query key^T / sqrt(head_dim)) value over (batch, tokens, heads, head_dim) tensors
    (the query's tokens may differ from the keys'), as one fused kernel: cuDNN's on padded tokens
    where `uses_padded_cudnn`, `keras.ops.dot_product_attention` otherwise."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    if uses_padded_cudnn(query.dtype, query.shape[-1]):
        attended = _padded_cudnn_or_none(query, key, value, scale)
        if attended is not None:
            return attended
    # Keras' flash route: not for training (cuDNN refuses the backward pass
    # of 197 tokens there and Keras would log that at every trace) and never
    # Keras' Splash route on a TPU.
    flash_attention = False if training or keeps_off_keras_splash() else None
    return ops.dot_product_attention(query, key, value, scale=scale, flash_attention=flash_attention)


def uses_padded_cudnn(dtype, head_dim):
    """Whether attention traced now runs cuDNN on padded tokens: JAX on a GPU,
    16-bit queries, a head width cuDNN takes."""
    target = policy.current()
    return (
        target.backend == "jax"
        and target.device == "gpu"
        and keras.backend.standardize_dtype(dtype) in ("bfloat16", "float16")
        and head_dim % CUDNN_HEAD_DIM_MULTIPLE == 0
        and head_dim <= CUDNN_MAX_HEAD_DIM
    )


def padded_attention(query, key, value, scale, implementation=None, multiple=CUDNN_TOKEN_MULTIPLE):
    """softmax(query key^T * scale) value over (batch, tokens, heads, head_dim)
    JAX arrays (the query's tokens may differ from the keys'), computed on the
    tokens padded with zeros to a multiple of `multiple`: the padded keys are
    masked out by their count (`key_value_seq_lengths`) and the padded queries'
    rows dropped, so the result is the unpadded attention's. `implementation`:
    JAX's, "cudnn" or "xla" (None: JAX's choice, XLA)."""
    import jax
    import jax.numpy as jnp

    batch, query_tokens, tokens = query.shape[0], query.shape[1], key.shape[1]

    def padded(x):
        padding = -x.shape[1] % multiple
        return jnp.pad(x, ((0, 0), (0, padding), (0, 0), (0, 0))) if padding else x

    # Padded keys masked by the count of real ones; padded queries' rows dropped below.
    lengths = jnp.full((batch,), tokens, jnp.int32) if tokens % multiple else None
    attended = jax.nn.dot_product_attention(
        padded(query), padded(key), padded(value), scale=scale, key_value_seq_lengths=lengths,
        implementation=implementation,
    )  # fmt: skip
    return attended[:, :query_tokens]


def _padded_cudnn_or_none(query, key, value, scale):
    """`padded_attention` through cuDNN, or None where JAX refuses it here
    (no cuDNN, a GPU before Ampere, a JAX without the route).

    The refusal is logged at debug level each time, which is each time an
    attention is traced: nothing is remembered between traces, and the
    fallback computes the same function."""
    try:
        return padded_attention(query, key, value, scale, implementation="cudnn")
    except (NotImplementedError, RuntimeError, ValueError) as error:
        logging.getLogger("keras_vit").debug(
            "cuDNN attention is not available here (%s: %s); attention runs as XLA's formulation.",
            type(error).__name__,
            error,
        )
        return None


def keeps_off_keras_splash():
    """Whether attention traced now must ask Keras for no flash kernel: on the JAX
    backend where Keras would run its Splash (TPU) kernel.

    Keras 3.15.1 (keras/src/backend/jax/nn.py, `dot_product_attention` and
    `wrap_flash_attention`) takes its Splash route whenever JAX's first device is
    a TPU (`jax.devices()[0].platform == "tpu"`) and `flash_attention` is None or
    True, and the kernel it builds there computes another function: with no mask
    it builds a causal mask (`splash_attention_mask.CausalMask`), and it multiplies
    the query by scale * sqrt(head_dim) on the belief that Splash divides by
    sqrt(head_dim), which Splash does not, so the logits go unscaled. Only token
    counts that Splash's 128-row blocks divide get there (e.g. 256: B/16 at 256
    px with the "gap" classifier); for others Splash refuses the shape and Keras
    logs the failure and falls back. `flash_attention=False` sends every shape to
    JAX's XLA formulation (`jax.nn.dot_product_attention(...,
    implementation="xla")`) with the scale as given and no mask.

    The guard can go when Keras' TPU route builds a full mask for `mask=None,
    is_causal=False` and scales the logits by `scale` exactly:
    tests/test_kernels_attention.py runs that route (Splash interpreted on the CPU) and
    its line asserting that the route still differs fails once it no longer does.
    """
    target = policy.current()
    # Keras reads JAX's first device (its default backend's), whatever keras_vit's policy concluded
    # from a `keras.distribution`: both are asked.
    return target.backend == "jax" and "tpu" in (target.device, policy.default_device("jax"))
