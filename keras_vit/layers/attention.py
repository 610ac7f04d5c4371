"""Multi-head self-attention (paper eq. 2 and appendix A, eq. 5-8)."""

import keras
import numpy as np

from keras_vit import kernels
from keras_vit.layers.common import add_stacked_projections, check_positive_int, check_rate, register
from keras_vit.layers.core import Dropout, check_norm, make_norm
from keras_vit.layers.quantization import Int8Kernels


@register
class MultiHeadSelfAttention(Int8Kernels, keras.layers.Layer):
    """Multi-head scaled dot-product self-attention.

    [q, k, v] = z U_qkv;  A = softmax(q k^T / sqrt(D_h));  MSA(z) = [A_1 v_1, ..., A_k v_k] U_msa

    The query, key and value projections are one matmul with a
    (hidden, 3, hidden) kernel: the original checkpoints' query, key and value
    kernels of shape (hidden, heads, head_dim), each reshaped to (hidden,
    hidden), stacked in that order on the middle axis. The last axis is heads x
    head_dim, so cutting it into N equal pieces gives each piece whole heads
    when N divides the heads (tensor parallelism, `keras_vit.distribute`). Files
    saved with the earlier (hidden, 3 * hidden) kernel and (3 * hidden,) bias,
    the same numbers in the same order, load unchanged. The softmax runs in
    float32 under mixed precision. How the attention is computed is
    `keras_vit.kernels.attention`'s choice.

    Args:
        num_heads: number of heads; the input width must be divisible by it.
        dropout_rate: dropout on the attention probabilities.
        seed: seed of the dropout.
        qkv_bias: the query, key and value projections have biases (the
            paper's; False: none, as timm's `qkv_bias=False` models).
        sub_norm: None, or a norm ("layer" or "rms", with `norm_epsilon`) of
            the heads' concatenated output before the output projection
            (BEiT-3's sub-LN; sublayer `norm`).

    Call args:
        inputs: (batch, tokens, hidden).
        training: dropout on or off.
        return_attention_scores: also return the attention probabilities,
            (batch, heads, tokens, tokens).

    Weights: `qkv_kernel` (hidden, 3, hidden), `qkv_bias` (3, hidden) (unless
    `qkv_bias=False`), `output_kernel` (hidden, hidden), `output_bias` (hidden,). Quantized to
    int8 (`model.quantize("int8")`, `keras_vit.layers.quantization`), both
    kernels are int8 with a float `qkv_kernel_scale` (3, hidden) and
    `output_kernel_scale` (hidden,).

    >>> attention = MultiHeadSelfAttention(num_heads=2)
    >>> outputs, scores = attention(keras.ops.zeros((1, 5, 8)), return_attention_scores=True)
    >>> tuple(outputs.shape), tuple(scores.shape)
    ((1, 5, 8), (1, 2, 5, 5))
    """

    QUANTIZED_KERNELS = ("qkv_kernel", "output_kernel")

    def __init__(self, num_heads, dropout_rate=0.0, seed=None, qkv_bias=True, sub_norm=None, norm_epsilon=1e-6,
                 **kwargs):  # fmt: skip
        super().__init__(**kwargs)
        self.norm = None  # Built with `sub_norm`.
        self.sub_norm = None if sub_norm is None else check_norm(sub_norm)
        self.norm_epsilon = float(norm_epsilon)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.dropout_rate = check_rate("dropout_rate", dropout_rate)
        self.seed = seed
        if not isinstance(qkv_bias, bool):
            raise ValueError(f"`qkv_bias` must be True or False. Received: qkv_bias={qkv_bias!r}")
        self.use_qkv_bias = qkv_bias

    def build(self, input_shape):
        hidden = input_shape[-1]
        if hidden is None or hidden % self.num_heads:
            raise ValueError(
                "The input width must be divisible by `num_heads`. Received: input_shape="
                f"{tuple(input_shape)}, num_heads={self.num_heads}"
            )
        self.qkv_kernel, self.qkv_bias = add_stacked_projections(self, "qkv", 3, hidden, bias=self.use_qkv_bias)
        self.output_kernel = self.add_weight(
            name="output_kernel", shape=(hidden, hidden), initializer="glorot_uniform"
        )
        self.output_bias = self.add_weight(name="output_bias", shape=(hidden,), initializer="zeros")
        self.attention_dropout = Dropout(
            self.dropout_rate, seed=self.seed, dtype=self.dtype_policy, name="attention_dropout"
        )
        self.norm = None
        if self.sub_norm is not None:
            self.norm = make_norm(self.sub_norm, self.norm_epsilon, dtype=self.dtype_policy, name="norm")
            self.norm.build(input_shape)
        self.build_quantized()

    def call(self, inputs, training=None, return_attention_scores=False):
        if not self.trainable:  # Frozen: inference mode, no attention dropout.
            training = False
        qkv = self.project(inputs, "qkv_kernel", self.qkv_bias)
        attended = kernels.attention(
            qkv,
            self.num_heads,
            training=training,
            dropout=self.attention_dropout if self.dropout_rate else None,
            return_probabilities=return_attention_scores,
        )
        if return_attention_scores:
            attended, scores = attended
        if self.norm is not None:
            attended = self.norm(attended)
        outputs = self.project(attended, "output_kernel", self.output_bias)
        return (outputs, scores) if return_attention_scores else outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def load_own_variables(self, store):
        """Keras' loading, also of files saved with the flat layout: a (hidden, 3 * hidden)
        `qkv_kernel` and a (3 * hidden,) `qkv_bias`, reshaped to (hidden, 3, hidden) and (3, hidden)."""
        if not self.built or self.quantization_mode is not None:
            return super().load_own_variables(store)
        arrays = {key: store[key] for key in store.keys()}
        # Keras keys a layer's own variables by creation order, trainable ones first:
        # `build` creates qkv_kernel first, then qkv_bias.
        for key, variable in (("0", self.qkv_kernel), ("1", self.qkv_bias)):
            if variable is None:
                continue
            shape = tuple(variable.shape)
            flat = (*shape[:-2], shape[-2] * shape[-1])
            if key in arrays and tuple(arrays[key].shape) == flat:
                arrays[key] = np.reshape(np.asarray(arrays[key]), shape)
        super().load_own_variables(arrays)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "dropout_rate": self.dropout_rate,
            "seed": self.seed,
            "qkv_bias": self.use_qkv_bias,
            "sub_norm": self.sub_norm,
            "norm_epsilon": self.norm_epsilon,
        }
