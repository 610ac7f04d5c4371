"""Which TensorFlow keras_vit runs with, and a clear error when there is none.

TensorFlow is not an install requirement: a machine has one build of it (`tensorflow`, `tensorflow-cpu`,
or `tensorflow-tpu` on a Cloud TPU VM) and a requirement on one distribution name would install a second
beside it. So the check happens at import time instead. The model, its layers, `fit` and
`keras_vit.distribute`'s meshes run on Keras' JAX backend without TensorFlow; the tf.data input, TF strategies,
SavedModel/TFLite export and the Keras TensorFlow backend need it.

This module imports nothing from keras_vit or Keras, so `keras_vit/__init__.py` can run it first.
"""

import importlib.util
import json
import os
from importlib import metadata

MINIMUM_TENSORFLOW = (2, 20)
# The distributions that install the `tensorflow` module.
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-tpu", "tensorflow-intel", "tf-nightly")
BUILDS = (
    "`pip install tensorflow` (or the library's extra: `pip install \"keras-vit[tensorflow]\"`) on a "
    "GPU or CPU machine, `tensorflow-cpu` for the input pipeline beside JAX, `tensorflow-tpu` on a "
    "Cloud TPU VM"
)


def version_tuple(version):
    numbers = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        numbers.append(int(digits))
    return tuple(numbers)


def keras_backend():
    """The backend Keras will use, read as Keras reads it, without importing Keras.

    `KERAS_BACKEND` wins; otherwise `keras.json` in `KERAS_HOME` (or `~/.keras`); otherwise
    Keras' default, "tensorflow".
    """
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as file:
            return json.load(file).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def missing_tensorflow_message(needed_by):
    return (
        f"{needed_by} needs TensorFlow {'.'.join(map(str, MINIMUM_TENSORFLOW))} or newer, and no TensorFlow "
        f"is importable in this Python environment. Install the one build that fits the machine: {BUILDS}."
    )


def check_tensorflow(needed_by="keras_vit"):
    """Raises ImportError naming the TensorFlow builds when none (or one too old) is importable."""
    try:
        spec = importlib.util.find_spec("tensorflow")
    except (ImportError, ValueError):  # a finder that refuses it, or a broken half-import
        spec = None
    if spec is None:
        raise ImportError(missing_tensorflow_message(needed_by))
    versions = list(installed_tensorflows().values())
    old = [v for v in versions if version_tuple(v) < MINIMUM_TENSORFLOW]
    if old and len(old) == len(versions):
        raise ImportError(
            f"{needed_by} needs TensorFlow {'.'.join(map(str, MINIMUM_TENSORFLOW))} or newer; this environment "
            f"has {old[0]}. Upgrade the build the machine uses: {BUILDS}."
        )


def installed_tensorflows():
    """{distribution: version} of the TensorFlow builds installed in this environment."""
    found = {}
    for name in TENSORFLOW_DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def import_tensorflow(needed_by):
    """`import tensorflow`, or an ImportError that names the builds to install (see `check_tensorflow`)."""
    check_tensorflow(needed_by)
    import tensorflow as tf

    return tf


def check_keras_backend():
    """Fails early, with the builds named, when Keras would use TensorFlow and there is none."""
    if keras_backend() == "tensorflow":
        check_tensorflow("keras_vit on Keras' TensorFlow backend (the default; KERAS_BACKEND=jax runs without it)")
