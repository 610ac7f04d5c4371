"""Attention as `keras.ops.dot_product_attention`: the fast form on GPUs and TPUs
with a backend other than TensorFlow.

There JAX runs cuDNN's fused (flash) attention on NVIDIA GPUs from Ampere on
for 16-bit inputs, Splash attention on TPUs, and its own XLA formulation
otherwise (logits and softmax in float32, like the reference form); PyTorch
runs `scaled_dot_product_attention`.
"""

import math

from keras import ops


def attention(qkv, num_heads, training=False):
    """The reference `attention`'s attended values, without probabilities or dropout."""
    tokens, width = qkv.shape[1], qkv.shape[2]
    hidden = width // 3
    head_dim = hidden // num_heads
    # (batch, tokens, heads, head_dim) is the layout the fused kernels take: no transposes.
    qkv = ops.reshape(qkv, (-1, tokens, 3, num_heads, head_dim))
    # Training asks for no flash kernel: cuDNN's has no backward pass for 197 tokens
    # (JAX 0.11: "Unsupported sequence length"); Keras would log that failure at every
    # trace and fall back to the XLA formulation, which this asks for directly.
    attended = ops.dot_product_attention(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        scale=1.0 / math.sqrt(head_dim),
        flash_attention=False if training else None,
    )
    return ops.reshape(attended, (-1, tokens, hidden))
