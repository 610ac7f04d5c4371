r"""Benchmarks of keras_vit on this machine.

    python -m experiments.benchmark --mode=patch_projection --variant=B/16 --batch_size=16
    python -m experiments.benchmark --mode=serving --variant=Ti/16 --image_size=224

`patch_projection`: the patch embedding as a strided conv versus patch cutting
plus one matmul (`PatchEncoder(projection=...)`), same weights, with and
without XLA; repetitions are interleaved and the median is reported, with the
ratio conv / matmul (> 1 means the conv is faster).

`serving`: file size and single-image latency (median of --repeats, after
warm-up) of the Keras model (a tf.function), its SavedModel signature and each
TFLite flavour (float32, float16, dynamic-range, int8; LiteRT interpreter with
as many threads as cores), with each one's ratio to the Keras model.
"""

import os
import tempfile

import statistics
import time

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

import keras_vit

_MODE = flags.DEFINE_enum("mode", "patch_projection", ["patch_projection", "serving"], "What to measure.")
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


def directory_size(path):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def serving(variant, image_size, repeats):
    from ai_edge_litert.interpreter import Interpreter

    from keras_vit import export

    model = keras_vit.build_vit(variant, image_size=image_size, num_classes=1000)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (1, image_size, image_size, 3)).astype(np.uint8)
    calibration = rng.integers(0, 256, (16, image_size, image_size, 3)).astype(np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        keras_path = os.path.join(tmp, "model.keras")
        model.save(keras_path)
        sizes = {"keras (.keras)": os.path.getsize(keras_path)}
        keras_fn = tf.function(lambda x: model(x, training=False))
        functions = {"keras (.keras)": lambda x: keras_fn(tf.cast(x, tf.float32))}
        saved = export.export_saved_model(model, os.path.join(tmp, "saved_model"))
        sizes["saved_model"] = directory_size(saved)
        signature = tf.saved_model.load(saved).signatures["serving_default"]
        functions["saved_model"] = lambda x: signature(images=tf.constant(x))["logits"]
        for quantize in export.QUANTIZATIONS:
            name = f"tflite {quantize or 'float32'}"
            path = export.export_tflite(
                model, os.path.join(tmp, f"{name}.tflite"), quantize=quantize, representative_data=calibration
            )
            sizes[name] = os.path.getsize(path)
            interpreter = Interpreter(model_path=path, num_threads=os.cpu_count())
            interpreter.allocate_tensors()
            detail = interpreter.get_input_details()[0]
            output = interpreter.get_output_details()[0]["index"]

            def run(x, interpreter=interpreter, detail=detail, output=output):
                interpreter.set_tensor(detail["index"], x.astype(detail["dtype"]))
                interpreter.invoke()
                return interpreter.get_tensor(output)

            functions[name] = run
        medians = time_calls(functions, image, repeats)
    print(f"Serving {variant} at {image_size} px, one image, {repeats} repeats, {os.cpu_count()} CPU cores:")
    print(f"  {'artefact':18s} {'size (MiB)':>10s} {'latency (ms)':>12s} {'vs keras':>9s}")
    base = medians["keras (.keras)"]
    for name, seconds in medians.items():
        print(f"  {name:18s} {sizes[name] / 2**20:10.2f} {1000 * seconds:12.2f} {base / seconds:8.2f}x")


def main(argv):
    del argv
    keras.utils.set_random_seed(0)
    if _MODE.value == "patch_projection":
        patch_projection(_VARIANT.value, _IMAGE_SIZE.value, _BATCH_SIZE.value, _REPEATS.value)
    elif _MODE.value == "serving":
        serving(_VARIANT.value, _IMAGE_SIZE.value, _REPEATS.value)


if __name__ == "__main__":
    app.run(main)
