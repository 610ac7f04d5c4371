"""Keras core layers whose computation goes through `keras_vit.kernels`.

Same constructor, weights and config as the Keras layer each extends, so
checkpoints and saved models see a Keras layer; the call picks the kernel form
for where it is traced.
"""

import keras

from keras_vit import kernels
from keras_vit.layers.common import read_renamed, register

# The MLP's activation, by timm's names for them: "gelu" (x Phi(x), the paper's), "gelu_tanh" (its tanh
# approximation, as Flax's `nn.gelu` computes it in the original implementation and big_vision), "quick_gelu"
# (OpenAI CLIP's x sigmoid(1.702 x)) or "silu" (x sigmoid(x), Elfwing et al. 2018; an MLP of that activation,
# ungated).
MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "silu")
# Configs saved before the option was named `activation` hold it as `gelu`, in these words.
_GELU_WORDS = {"exact": "gelu", "tanh": "gelu_tanh", "quick": "quick_gelu", "silu": "silu"}


@register
def gelu_tanh(x):
    """GELU's tanh approximation, a registered activation (it survives saving): x * (1 + tanh(sqrt(2 / pi)
    * (x + 0.044715 x^3))) / 2.

    >>> round(float(gelu_tanh(keras.ops.convert_to_tensor(1.0))), 6)
    0.841192
    """
    return kernels.reference.gelu_tanh(x)


@register
def gelu_quick(x):
    """The "quick GELU" of OpenAI's CLIP models (Radford et al. 2021; timm's `QuickGELU`, transformers'
    "quick_gelu"), a registered activation: x * sigmoid(1.702 x), a sigmoid approximation of x Phi(x)
    (Hendrycks and Gimpel 2016, section 2).

    >>> round(float(gelu_quick(keras.ops.convert_to_tensor(1.0))), 6)
    0.845796
    """
    return x * keras.ops.sigmoid(1.702 * x)


def mlp_activation(activation):
    """The `Dense` activation of the MLP activation named `activation` (one of `MLP_ACTIVATIONS`); a ValueError
    otherwise."""
    if activation not in MLP_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {MLP_ACTIVATIONS}. Received: activation={activation!r}")
    return {"gelu": "gelu", "gelu_tanh": gelu_tanh, "quick_gelu": gelu_quick, "silu": "silu"}[activation]


def read_activation(config):
    """A copy of `config` (a layer's or a spec's) with a `gelu` entry, as configs saved before the option was
    named `activation` hold it, read as `activation`; a ValueError for a `gelu` entry that is no such word."""
    return read_renamed(config, "gelu", "activation", _GELU_WORDS)


@register
class Dense(keras.layers.Dense):
    """`keras.layers.Dense` computed by `kernels.dense`; activation "gelu" is the exact GELU,
    `gelu_tanh` its tanh approximation (both fused with the matmul where a kernel can), `gelu_quick` CLIP's.

    >>> tuple(Dense(4, activation="gelu")(keras.ops.ones((2, 3, 5))).shape)
    (2, 3, 4)
    """

    def quantize(self, mode=None, type_check=True, config=None):
        # Keras' Dense quantizes its subclasses when told that they compute what it computes, as this one does;
        # quantized, Keras' own int8/int4/float8 call runs instead of `call`.
        super().quantize(mode, type_check=False, config=config)

    def _int8_call(self, inputs, training=None):
        # Keras' int8 call for training (its gradient) and LoRA; the matmul of `kernels.int8_dense` otherwise.
        if training or self.lora_enabled:
            return super()._int8_call(inputs, training=training)
        y = kernels.int8_dense(inputs, self._kernel, self.kernel_scale, self.bias, self.compute_dtype,
                               self.inputs_quantizer)  # fmt: skip
        return y if self.activation is None else self.activation(y)

    def call(self, inputs, training=None):
        # The activations `kernels.dense` computes itself (fused with the matmul where it can).
        fused = {keras.activations.gelu: "gelu", gelu_tanh: "gelu_tanh"}.get(self.activation)
        if fused:
            return kernels.dense(inputs, self.kernel, self.bias, activation=fused)
        return self.activation(kernels.dense(inputs, self.kernel, self.bias))


@register
class LayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` over the last axis computed by `kernels.layer_norm`.

    >>> tuple(LayerNormalization(epsilon=1e-6)(keras.ops.ones((2, 3, 5))).shape)
    (2, 3, 5)
    """

    def call(self, inputs, training=None):
        training = training and self.trainable  # Frozen: the inference kernel.
        last_axis = tuple(self.axis) in ((-1,), (len(inputs.shape) - 1,))
        if not (last_axis and self.center and self.scale) or self.rms_scaling:
            return super().call(inputs)
        return kernels.layer_norm(inputs, self.gamma, self.beta, self.epsilon, training=training)


# The norms: "layer" (LayerNorm, the paper's) or "rms" (RMSNorm, Zhang and Sennrich 2019: x / sqrt(mean(x^2) + eps)
# times a learned scale, no centring and no bias; timm's AIMv2 and some of its newer ViTs).
NORMS = ("layer", "rms")


def check_norm(norm):
    if norm not in NORMS:
        raise ValueError(f"`norm` must be one of {NORMS}. Received: norm={norm!r}")
    return norm


def make_norm(norm, epsilon, **kwargs):
    """A norm layer of kind `norm` ("layer": `LayerNormalization`, weights `gamma`, `beta`; "rms": Keras'
    `RMSNormalization`, weight `scale`) over the last axis with `epsilon`."""
    if check_norm(norm) == "rms":
        return keras.layers.RMSNormalization(epsilon=epsilon, **kwargs)
    return LayerNormalization(epsilon=epsilon, **kwargs)


@register
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` computed by `kernels.dropout`; frozen (`trainable=False`), it drops nothing.

    >>> layer = Dropout(0.5, seed=0)
    >>> bool(keras.ops.all(layer(keras.ops.ones((2, 3)), training=False) == 1.0))
    True
    """

    def call(self, inputs, training=False):
        # A frozen layer runs in inference mode, as Keras' transfer-learning guide runs a frozen base.
        if training and self.rate > 0 and self.trainable:
            return kernels.dropout(inputs, self.rate, self.seed_generator, self.noise_shape)
        return inputs
