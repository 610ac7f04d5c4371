"""What the layers share: registration for saving, reading configs saved under earlier names, argument checks,
stacked projections."""

import math

import keras

register = keras.saving.register_keras_serializable(package="keras_vit")


def read_renamed(config, old, new, words=None):
    """A copy of the saved `config` (a layer's or a spec's) with its entry `old`, the name earlier files give
    `new`, read as `new`: its value as it is, or through `words` ({earlier value: value}), a ValueError naming
    them for any other. `config` itself when it has no `old`."""
    if old not in config:
        return config
    config = dict(config)
    value = config.pop(old)
    if words is not None:
        if value not in words:
            raise ValueError(f"A saved `{old}` must be one of {tuple(words)}. Received: {old}={value!r}")
        value = words[value]
    config.setdefault(new, value)
    return config


def check_rate(name, value):
    """`value` as a float in [0, 1); a ValueError naming `name` otherwise."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1). Received: {name}={value!r}")
    return float(value)


def check_positive_int(name, value, optional=False):
    """`value` if it is a positive int (or, if `optional`, None); a ValueError naming `name` otherwise."""
    if optional and value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        expected = "a positive integer or None" if optional else "a positive integer"
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")
    return value


def add_stacked_projections(layer, name, count, hidden, bias=True):
    """Creates `count` (hidden, hidden) projections stacked on the middle axis: `<name>_kernel`
    (hidden, count, hidden) and `<name>_bias` (count, hidden), in that order; returns both (the bias None
    with `bias=False`).

    The kernel is Glorot-uniform as if each projection were its own (hidden, hidden) kernel: the
    limit sqrt(6 / (hidden + hidden)). Keras' fans of a 3-D kernel would count the first axis as a
    receptive field.
    """
    limit = math.sqrt(3.0 / hidden)
    kernel = layer.add_weight(
        name=f"{name}_kernel",
        shape=(hidden, count, hidden),
        initializer=keras.initializers.RandomUniform(-limit, limit),
    )
    if not bias:
        return kernel, None
    return kernel, layer.add_weight(name=f"{name}_bias", shape=(count, hidden), initializer="zeros")
