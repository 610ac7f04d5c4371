r"""Benchmarks of keras_vit on this machine.

    python -m experiments.benchmark --mode=patch_projection --variant=B/16 --batch_size=16

`patch_projection`: the patch embedding as a strided conv versus patch cutting
plus one matmul (`PatchEncoder(projection=...)`), same weights, with and
without XLA; repetitions are interleaved and the median is reported, with the
ratio conv / matmul (> 1 means the conv is faster).
"""

import statistics
import time

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

import keras_vit

_MODE = flags.DEFINE_enum("mode", "patch_projection", ["patch_projection"], "What to measure.")
_VARIANT = flags.DEFINE_string("variant", "B/16", "ViT variant, e.g. B/16.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Square image size in pixels.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 16, "Images per batch.")
_REPEATS = flags.DEFINE_integer("repeats", 30, "Timed repetitions per configuration.")


def time_calls(functions, inputs, repeats):
    """Median seconds per call of each function, calls interleaved, after warm-up."""
    for fn in functions.values():
        for _ in range(3):
            np.asarray(fn(inputs))
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.perf_counter()
            np.asarray(fn(inputs))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def patch_projection(variant, image_size, batch_size, repeats):
    config = keras_vit.parse_variant(variant)
    shape = (batch_size, image_size, image_size, 3)
    images = tf.constant(np.random.default_rng(0).uniform(-1, 1, shape).astype("float32"))
    encoders = {}
    for projection in keras_vit.PatchEncoder.PROJECTIONS:
        encoders[projection] = keras_vit.PatchEncoder(
            config.hidden_dim, config.patch_size, projection=projection
        )
        encoders[projection].build(shape)
    weights = encoders["conv"].get_weights()
    encoders["matmul"].set_weights(weights)
    functions = {
        f"{projection} jit={jit}": tf.function(encoder.__call__, jit_compile=jit)
        for projection, encoder in encoders.items()
        for jit in (False, True)
    }
    medians = time_calls(functions, images, repeats)
    print(f"Patch embedding of {variant} at {image_size} px, batch {batch_size}, {repeats} repeats:")
    for name, seconds in medians.items():
        print(f"  {name:18s} {1000 * seconds:8.2f} ms  {batch_size / seconds:10.1f} images/s")
    for jit in (False, True):
        ratio = medians[f"matmul jit={jit}"] / medians[f"conv jit={jit}"]
        print(f"  jit={jit}: conv is {ratio:.2f}x the speed of matmul")


def main(argv):
    del argv
    keras.utils.set_random_seed(0)
    if _MODE.value == "patch_projection":
        patch_projection(_VARIANT.value, _IMAGE_SIZE.value, _BATCH_SIZE.value, _REPEATS.value)


if __name__ == "__main__":
    app.run(main)
