"""Attention as `keras.ops.dot_product_attention`: the fast form on GPUs and TPUs
with a backend other than TensorFlow.

There JAX runs cuDNN's fused (flash) attention on NVIDIA GPUs from Ampere on
for 16-bit inputs and its own XLA formulation otherwise (logits and softmax in
float32, like the reference form); PyTorch runs `scaled_dot_product_attention`.
On TPUs this form asks Keras for no flash kernel (`keeps_off_keras_splash`).
"""

import math

import keras
from keras import ops

from keras_vit.kernels import policy, reference


def attention(qkv, num_heads, training=False):
    """The reference `attention`'s attended values, without probabilities or dropout."""
    tokens = qkv.shape[1]
    hidden = reference.qkv_width(qkv)
    head_dim = hidden // num_heads
    # (batch, tokens, heads, head_dim) is the layout the fused kernels take: no transposes.
    qkv = ops.reshape(qkv, (-1, tokens, 3, num_heads, head_dim))
    # Training asks for no flash kernel: cuDNN's has no backward pass for 197 tokens
    # (JAX 0.11: "Unsupported sequence length"); Keras would log that failure at every
    # trace and fall back to the XLA formulation, which this asks for directly.
    flash_attention = False if training or keeps_off_keras_splash() else None
    attended = ops.dot_product_attention(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        scale=1.0 / math.sqrt(head_dim),
        flash_attention=flash_attention,
    )
    return ops.reshape(attended, (-1, tokens, hidden))


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
    tests/test_kernels.py runs that route (Splash interpreted on the CPU) and
    its line asserting that the route still differs fails once it no longer does.
    """
    if keras.backend.backend() != "jax":
        return False
    if policy.current().device == "tpu":
        return True
    import jax

    # What Keras itself reads, whatever keras_vit's policy concluded.
    return jax.devices()[0].platform == "tpu"
