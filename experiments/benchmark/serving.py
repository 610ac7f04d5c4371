"""`--mode=serving`: file size and latency of each export of a model, at each batch size, with each one's share
of the machine's matmul peak in its runtime and precision.

The Keras model (a tf.function), its SavedModel in each precision (float32, bfloat16, int8:
`export_saved_model(precision=...)`), each TFLite flavour (float32, float16, dynamic-range, int8; LiteRT's
interpreter, XNNPACK) and, where onnxruntime imports, the model's ONNX export (and, where timm imports, timm's ViT
of the same architecture exported by PyTorch) in ONNX Runtime, float32 and dynamically quantized to int8
(`onnxruntime.quantization.quantize_dynamic`): the median of --repeats calls
after warm-up, all on the same pixels and `threads` threads. Each row's "of peak" is its FLOP/s (the model's
FLOPs over its latency) against the peak of the same runtime and precision at the model's shapes and batch
(`peaks.measure_peaks`, timed in the same run); ONNX Runtime's rows have none of ours. Ratios: each artefact
against the Keras model, and our best SavedModel and TFLite against ONNX Runtime's best.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile

import keras
import numpy as np

import keras_vit
from experiments.benchmark import peers
from experiments.benchmark.peaks import measure_peaks, peaks_of, use_threads
from experiments.benchmark.results import cpu_flags, cpu_line
from experiments.benchmark.timing import time_calls

# The peak each artefact is held against: (runtime, precision) of `peaks.measure_peaks`.
PEAK_OF = {
    "keras (.keras)": ("tensorflow", "float32"),
    "saved_model": ("tensorflow", "float32"),
    "saved_model bfloat16": ("tensorflow", "bfloat16"),
    "saved_model int8": ("tensorflow", "int8"),
    "tflite float32": ("litert", "float32"),
    "tflite float16": ("litert", "float32"),  # float16 weights, float32 arithmetic on CPUs
    "tflite dynamic": ("litert", "dynamic int8"),
    "tflite int8": ("litert", "int8"),
}


def directory_size(path):
    """Bytes of every file under `path`."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _litert(path, threads):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path, num_threads=threads)
    detail = interpreter.get_input_details()[0]
    output = interpreter.get_output_details()[0]["index"]
    shape = [None]

    def run(x):
        if shape[0] != x.shape:
            interpreter.resize_tensor_input(detail["index"], x.shape)
            interpreter.allocate_tensors()
            shape[0] = x.shape
        interpreter.set_tensor(detail["index"], x.astype(detail["dtype"]))
        interpreter.invoke()
        return interpreter.get_tensor(output)

    return run


# The ONNX export in a process of its own: tf2onnx's graph optimiser holds about 20 GB at B/16 (measured with
# TensorFlow 2.21 and tf2onnx 1.17), which it gives back when that process ends.
_EXPORT_ONNX = (
    "import sys, keras; from keras_vit import export; "
    "export.export_onnx(keras.saving.load_model(sys.argv[1]), sys.argv[2])"
)


def _timm_pixels(x):
    """uint8 (batch, height, width, 3) pixels as timm's ViT takes them: NCHW, scaled to [-1, 1] (its mean and
    standard deviation of 0.5)."""
    return np.ascontiguousarray((x.astype(np.float32) / 127.5 - 1.0).transpose(0, 3, 1, 2))


def timm_peer(model, timm_python=None):
    """What `onnxruntime_sessions` needs to export timm's ViT of `model`'s architecture, size and classes, where
    timm imports (in this interpreter or in `timm_python`); else None, and says so."""
    if timm_python or importlib.util.find_spec("timm"):
        spec = model.spec
        return spec.config, spec.image_size[0], spec.num_classes, timm_python
    print("timm is not installed here (--timm_python names an interpreter that has it): its ONNX export is left out.")
    return None


def onnxruntime_sessions(keras_path, folder, threads, timm=None):
    """{name: (function, size)} in ONNX Runtime, float32 and dynamically quantized to int8, of the model saved at
    `keras_path` exported by `export.export_onnx` and, given `timm` (`timm_peer`'s), of timm's ViT of the same
    architecture exported by PyTorch ("onnxruntime timm ..."; its calls include scaling the pixels and
    transposing them to its layout). {} without onnxruntime."""
    try:
        import onnxruntime
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        return {}
    exports = {"onnxruntime": (os.path.join(folder, "model.onnx"), lambda x: x.astype(np.float32))}
    subprocess.run([sys.executable, "-c", _EXPORT_ONNX, keras_path, exports["onnxruntime"][0]], check=True,
                   capture_output=True)  # fmt: skip
    if timm is not None:
        config, image_size, num_classes, python = timm
        path = os.path.join(folder, "timm.onnx")
        versions = peers.export_timm_onnx(config, image_size, num_classes, path, python=python)
        print(f"timm's ONNX export: timm {versions['timm']}, torch {versions['torch']}")
        exports["onnxruntime timm"] = (path, _timm_pixels)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    functions = {}
    for prefix, (float32, prepare) in exports.items():
        int8 = float32.replace(".onnx", "_int8.onnx")
        quantize_dynamic(float32, int8, weight_type=QuantType.QInt8)
        for name, path in ((f"{prefix} float32", float32), (f"{prefix} int8", int8)):
            session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            input_name = session.get_inputs()[0].name
            functions[name] = (
                lambda x, session=session, input_name=input_name, prepare=prepare: session.run(
                    None, {input_name: prepare(x)}
                )[0],
                os.path.getsize(path),
            )
    return functions


def saved_models(model, folder):
    """{name: path} of `model` exported as a SavedModel in each precision under `folder`: "saved_model" (float32),
    "saved_model bfloat16", "saved_model int8"."""
    from keras_vit import export

    paths = {}
    for precision in export.PRECISIONS:
        name = "saved_model" if precision == "float32" else f"saved_model {precision}"
        paths[name] = export.export_saved_model(model, os.path.join(folder, name), precision=precision)
    return paths


def serving(variant, image_size, repeats, batches=(1,), threads=None, timm_python=None):
    """Prints and returns {"figures": {"bytes": {artefact: size}, "seconds": {batch: {artefact: latency}},
    "of_peak": {batch: {artefact: share}}, "peaks": {batch: peaks}, "cpu_flags"}, "ratios"}."""
    import tensorflow as tf

    from keras_vit import export
    from keras_vit.flops import count_flops

    threads = use_threads(threads)
    keras.mixed_precision.set_dtype_policy("float32")
    model = keras_vit.build_vit(variant, image_size=image_size, num_classes=1000)
    rng = np.random.default_rng(0)
    calibration = rng.integers(0, 256, (16, image_size, image_size, 3)).astype(np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        keras_path = os.path.join(tmp, "model.keras")
        model.save(keras_path)
        sizes = {"keras (.keras)": os.path.getsize(keras_path)}
        onnx = onnxruntime_sessions(keras_path, tmp, threads, timm_peer(model, timm_python))
        keras_fn = tf.function(lambda x: model(x, training=False))
        functions = {"keras (.keras)": lambda x: keras_fn(tf.cast(x, tf.float32))}
        for name, saved in saved_models(model, tmp).items():
            sizes[name] = directory_size(saved)
            signature = tf.saved_model.load(saved).signatures["serving_images"]
            functions[name] = lambda x, signature=signature: signature(images=tf.constant(x))["logits"]
        for quantize in export.QUANTIZATIONS:
            name = f"tflite {quantize or 'float32'}"
            path = export.export_tflite(
                model, os.path.join(tmp, f"{name}.tflite"), quantize=quantize, representative_data=calibration,
                batch_size=None,
            )  # fmt: skip
            sizes[name] = os.path.getsize(path)
            functions[name] = _litert(path, threads)
        for name, (function, size) in onnx.items():
            functions[name], sizes[name] = function, size
        seconds, shares, peaks = {}, {}, {}
        for batch in batches:
            images = rng.integers(0, 256, (batch, image_size, image_size, 3)).astype(np.uint8)
            seconds[batch] = time_calls(functions, images, repeats)
            peaks[batch] = peaks_of(measure_peaks(variant, image_size, batch, max(repeats // 2, 1), threads))
            flops = batch * count_flops(variant, image_size=image_size)
            shares[batch] = {
                name: flops / latency / peaks[batch][PEAK_OF[name][0]][PEAK_OF[name][1]]
                for name, latency in seconds[batch].items()
                if name in PEAK_OF and PEAK_OF[name][1] in peaks[batch][PEAK_OF[name][0]]
            }
    flags = cpu_flags()
    ratios = _print(variant, image_size, repeats, threads, flags, sizes, seconds, shares)
    return {
        "figures": {"bytes": sizes, "seconds": seconds, "of_peak": shares, "peaks": peaks, "cpu_flags": flags,
                    "threads": threads},
        "ratios": ratios,
    }  # fmt: skip


def _print(variant, image_size, repeats, threads, flags, sizes, seconds, shares):
    print(f"Serving {variant} at {image_size} px, {repeats} repeats, {threads} threads, on {cpu_line(flags)}:")
    ratios = {}
    for batch, medians in seconds.items():
        print(f"  batch {batch}:")
        print(f"  {'artefact':25s} {'size (MiB)':>10s} {'latency (ms)':>12s} {'vs keras':>9s} {'of peak':>8s}")
        base = medians["keras (.keras)"]
        for name, latency in medians.items():
            share = f"{100 * shares[batch][name]:7.1f}%" if name in shares[batch] else f"{'—':>8s}"
            print(f"  {name:25s} {sizes[name] / 2**20:10.2f} {1000 * latency:12.2f} {base / latency:8.2f}x {share}")
            ratios[f"batch {batch}: {name} / keras"] = {"ratio": base / latency, "against": "keras (.keras)"}
        onnx = {name: latency for name, latency in medians.items() if name.startswith("onnxruntime")}
        if onnx:
            peer = min(onnx, key=onnx.get)
            for ours in ("saved_model", "tflite"):
                best = min((n for n in medians if n.startswith(ours)), key=medians.get)
                ratios[f"batch {batch}: {best} / {peer}"] = {"ratio": onnx[peer] / medians[best], "against": peer}
                print(f"  {best} against {peer}: {onnx[peer] / medians[best]:.2f}x")
    return ratios
