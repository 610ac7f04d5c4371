"""Keras core layers whose computation goes through `keras_vit.kernels`.

Same constructor, weights and config as the Keras layer each extends, so
checkpoints and saved models see a Keras layer; the call picks the kernel form
for where it is traced.
"""

import keras

from keras_vit import kernels
from keras_vit.layers.common import register


@register
class Dense(keras.layers.Dense):
    """`keras.layers.Dense` computed by `kernels.dense`; activation "gelu" is the exact GELU.

    >>> tuple(Dense(4, activation="gelu")(keras.ops.ones((2, 3, 5))).shape)
    (2, 3, 4)
    """

    def call(self, inputs, training=None):
        if self.activation is keras.activations.gelu:
            return kernels.dense(inputs, self.kernel, self.bias, activation="gelu")
        return self.activation(kernels.dense(inputs, self.kernel, self.bias))


@register
class LayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` over the last axis computed by `kernels.layer_norm`.

    >>> tuple(LayerNormalization(epsilon=1e-6)(keras.ops.ones((2, 3, 5))).shape)
    (2, 3, 5)
    """

    def call(self, inputs, training=None):
        last_axis = tuple(self.axis) in ((-1,), (len(inputs.shape) - 1,))
        if not (last_axis and self.center and self.scale) or self.rms_scaling:
            return super().call(inputs)
        return kernels.layer_norm(inputs, self.gamma, self.beta, self.epsilon, training=training)


@register
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` computed by `kernels.dropout`.

    >>> layer = Dropout(0.5, seed=0)
    >>> bool(keras.ops.all(layer(keras.ops.ones((2, 3)), training=False) == 1.0))
    True
    """

    def call(self, inputs, training=False):
        if training and self.rate > 0:
            return kernels.dropout(inputs, self.rate, self.seed_generator, self.noise_shape)
        return inputs
