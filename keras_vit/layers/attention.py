"""Multi-head self-attention (paper eq. 2 and appendix A, eq. 5-8)."""

import keras

from keras_vit import kernels
from keras_vit.layers.common import check_positive_int, check_rate, register
from keras_vit.layers.core import Dropout


@register
class MultiHeadSelfAttention(keras.layers.Layer):
    """Multi-head scaled dot-product self-attention.

    [q, k, v] = z U_qkv;  A = softmax(q k^T / sqrt(D_h));  MSA(z) = [A_1 v_1, ..., A_k v_k] U_msa

    The query, key and value projections are one matmul with a
    (hidden, 3 * hidden) kernel: the original checkpoints' query, key and value
    kernels of shape (hidden, heads, head_dim), reshaped to (hidden, hidden) and
    concatenated in that order. The softmax runs in float32 under mixed
    precision. How the attention is computed is `keras_vit.kernels.attention`'s
    choice.

    Args:
        num_heads: number of heads; the input width must be divisible by it.
        dropout_rate: dropout on the attention probabilities.
        seed: seed of the dropout.

    Call args:
        inputs: (batch, tokens, hidden).
        training: dropout on or off.
        return_attention_scores: also return the attention probabilities,
            (batch, heads, tokens, tokens).

    Weights: `qkv_kernel` (hidden, 3 * hidden), `qkv_bias` (3 * hidden,),
    `output_kernel` (hidden, hidden), `output_bias` (hidden,).

    >>> attention = MultiHeadSelfAttention(num_heads=2)
    >>> outputs, scores = attention(keras.ops.zeros((1, 5, 8)), return_attention_scores=True)
    >>> tuple(outputs.shape), tuple(scores.shape)
    ((1, 5, 8), (1, 2, 5, 5))
    """

    def __init__(self, num_heads, dropout_rate=0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.dropout_rate = check_rate("dropout_rate", dropout_rate)
        self.seed = seed

    def build(self, input_shape):
        hidden = input_shape[-1]
        if hidden is None or hidden % self.num_heads:
            raise ValueError(
                "The input width must be divisible by `num_heads`. Received: input_shape="
                f"{tuple(input_shape)}, num_heads={self.num_heads}"
            )
        # Glorot-uniform as if q, k and v were three (hidden, hidden) kernels:
        # for a (hidden, 3 * hidden) kernel fan_avg is 2 * hidden, so scale 2
        # restores the limit sqrt(6 / (hidden + hidden)).
        self.qkv_kernel = self.add_weight(
            name="qkv_kernel",
            shape=(hidden, 3 * hidden),
            initializer=keras.initializers.VarianceScaling(2.0, "fan_avg", "uniform"),
        )
        self.qkv_bias = self.add_weight(name="qkv_bias", shape=(3 * hidden,), initializer="zeros")
        self.output_kernel = self.add_weight(
            name="output_kernel", shape=(hidden, hidden), initializer="glorot_uniform"
        )
        self.output_bias = self.add_weight(name="output_bias", shape=(hidden,), initializer="zeros")
        self.attention_dropout = Dropout(self.dropout_rate, seed=self.seed, name="attention_dropout")

    def call(self, inputs, training=None, return_attention_scores=False):
        qkv = kernels.dense(inputs, self.qkv_kernel, self.qkv_bias)
        attended = kernels.attention(
            qkv,
            self.num_heads,
            training=training,
            dropout=self.attention_dropout if self.dropout_rate else None,
            return_probabilities=return_attention_scores,
        )
        if return_attention_scores:
            attended, scores = attended
        outputs = kernels.dense(attended, self.output_kernel, self.output_bias)
        return (outputs, scores) if return_attention_scores else outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "dropout_rate": self.dropout_rate,
            "seed": self.seed,
        }
