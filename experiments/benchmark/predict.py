"""`--mode=predict`: images per second of the prediction job over a folder of JPEGs, end to end.

`keras_vit.prediction.predict_files` (what `python -m experiments.predict` runs) on JPEGs cut from scikit-image's
photos (500 x 375, `inputs.write_photo_folder`), at each batch size, with the Keras model and its SavedModel in
each precision (`export_saved_model(precision=...)`, loaded once beforehand with `prediction.load_saved_model`
as the Keras model is built beforehand; the loading's seconds are printed apart): files read, decoded, resized
and cropped, batches through the model, the top classes out. Against ONNX Runtime (float32, `quantize_dynamic`
int8) running the model's ONNX export and, where timm imports, timm's ViT of the same architecture exported by
PyTorch, on the same images decoded and prepared beforehand, so that ONNX Runtime's figures leave the decoding
out.

The SavedModel's job decodes each file twice: once in the input pipeline to check it (a file that cannot be
decoded is skipped and reported rather than failing its batch), once inside `serving_bytes`. The decoding's own
rate (`keras_vit.prediction.image_decoder` over the folder in a tf.data pipeline) is printed beside: the share of
the job's time the check costs is about the job's rate over the decoding's.
"""

import os
import tempfile
import time

import numpy as np

import keras_vit
from experiments.benchmark.inputs import write_photo_folder
from experiments.benchmark.peaks import use_threads
from experiments.benchmark.results import cpu_flags, cpu_line
from experiments.benchmark.serving import onnxruntime_sessions, saved_models, timm_peer


def _seconds(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def decoded_images(paths, image_size):
    """The images as the job's pipeline prepares them (`image_decoder`: decoded, resized, center-cropped), and
    the seconds a tf.data pipeline took to make them."""
    import tensorflow as tf

    from keras_vit.data import ImageLimits
    from keras_vit.prediction import image_decoder

    decode = image_decoder(ImageLimits(), 3, None, (image_size, image_size), None)
    dataset = tf.data.Dataset.from_tensor_slices(paths).map(tf.io.read_file).map(
        decode, num_parallel_calls=tf.data.AUTOTUNE
    )
    start = time.perf_counter()
    images = np.stack(list(dataset.as_numpy_iterator()))
    return images, time.perf_counter() - start


def predict_throughput(variant, image_size, batches, count, repeats, threads=None, timm_python=None):
    """Prints and returns {"figures": {"images_per_second": {batch: {name: rate}}, "decode_images_per_second",
    "cpu_flags", "threads"}, "ratios"}."""
    from keras_vit import prediction

    threads = use_threads(threads)
    model = keras_vit.build_vit(variant, image_size=image_size, num_classes=1000)
    with tempfile.TemporaryDirectory() as tmp:
        write_photo_folder(os.path.join(tmp, "images"), count, (500, 375))
        paths = sorted(
            os.path.join(root, name) for root, _, files in os.walk(os.path.join(tmp, "images")) for name in files
        )
        keras_path = os.path.join(tmp, "model.keras")
        model.save(keras_path)
        sessions = onnxruntime_sessions(keras_path, tmp, threads, timm_peer(model, timm_python))
        artefacts = {"keras (.keras)": model}
        load_seconds = {}
        for name, folder in saved_models(model, tmp).items():  # Loaded once, as a server or a long job does.
            start = time.perf_counter()
            artefacts[name] = prediction.load_saved_model(folder)
            load_seconds[name] = time.perf_counter() - start
        images, decode_seconds = decoded_images(paths, image_size)
        decode_rate = len(paths) / decode_seconds
        rates = {}
        for batch in batches:
            jobs = {
                name: (lambda a=artefact, b=batch: list(prediction.predict_files(a, paths, batch_size=b)))
                for name, artefact in artefacts.items()
            }
            for name, (run, _) in sessions.items():
                jobs[name] = lambda run=run, b=batch: [run(images[i : i + b]) for i in range(0, len(images), b)]
            for job in jobs.values():  # Warm-up: traces, loads, the first batches.
                job()
            seconds = {name: [] for name in jobs}
            for _ in range(repeats):
                for name, job in jobs.items():
                    seconds[name].append(_seconds(job))
            rates[batch] = {name: len(paths) / float(np.median(values)) for name, values in seconds.items()}
    return _print(variant, image_size, count, repeats, threads, rates, decode_rate, load_seconds)


def _print(variant, image_size, count, repeats, threads, rates, decode_rate, load_seconds):
    flags = cpu_flags()
    print(
        f"Predicting with {variant} at {image_size} px over {count} JPEGs (500x375), median of {repeats}, "
        f"{threads} threads, on {cpu_line(flags)}:"
    )
    print(f"  decoding alone (read, decode, resize, crop; tf.data): {decode_rate:.1f} images/s")
    print("  loading (once, not timed below): " + ", ".join(f"{n} {s:.1f} s" for n, s in load_seconds.items()))
    ratios = {}
    for batch, by_name in rates.items():
        print(f"  batch {batch}:")
        base = by_name["keras (.keras)"]
        for name, rate in by_name.items():
            decoding = "pixels given" if name.startswith("onnxruntime") else "files"
            print(f"  {name:25s} {rate:9.2f} images/s {rate / base:6.2f}x   ({decoding})")
        onnx = {name: rate for name, rate in by_name.items() if name.startswith("onnxruntime")}
        if onnx:
            peer = max(onnx, key=onnx.get)
            best = max((n for n in by_name if n.startswith("saved_model")), key=by_name.get)
            ratios[f"batch {batch}: {best} / {peer}"] = {"ratio": by_name[best] / onnx[peer], "against": peer}
            print(f"  {best} against {peer}: {by_name[best] / onnx[peer]:.2f}x")
    return {
        "figures": {"images_per_second": rates, "decode_images_per_second": decode_rate,
                    "load_seconds": load_seconds, "cpu_flags": flags, "threads": threads},
        "ratios": ratios,
    }  # fmt: skip
