"""`--mode=serving`: file size and one-image latency of each export of a model.

The Keras model (a tf.function), its SavedModel signature and each TFLite
flavour (float32, float16, dynamic-range, int8; LiteRT interpreter with as
many threads as cores): the median of --repeats calls after warm-up, with each
one's ratio to the Keras model.
"""

import os
import tempfile

import keras
import numpy as np

import keras_vit
from experiments.benchmark.timing import time_calls


def directory_size(path):
    """Bytes of every file under `path`."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def serving(variant, image_size, repeats):
    """Prints and returns {"figures": {"bytes": {artefact: size}, "seconds": {artefact: latency}}, "ratios"}."""
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    from keras_vit import export

    keras.mixed_precision.set_dtype_policy("float32")
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
        signature = tf.saved_model.load(saved).signatures["serving_images"]
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
    ratios = {}
    for name, seconds in medians.items():
        ratios[f"{name} / keras"] = {"ratio": base / seconds}
        print(f"  {name:18s} {sizes[name] / 2**20:10.2f} {1000 * seconds:12.2f} {base / seconds:8.2f}x")
    return {"figures": {"bytes": sizes, "seconds": medians}, "ratios": ratios}
