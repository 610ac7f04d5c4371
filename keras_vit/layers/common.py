"""What the layers share: registration for saving and argument checks."""

import keras

register = keras.saving.register_keras_serializable(package="keras_vit")


def check_rate(name, value):
    """`value` as a float in [0, 1); a ValueError naming `name` otherwise."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1). Received: {name}={value!r}")
    return float(value)


def check_positive_int(name, value):
    """`value` if it is a positive int; a ValueError naming `name` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return value
