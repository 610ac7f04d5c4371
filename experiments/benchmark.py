r"""Benchmarks of keras_vit on this machine.

    python -m experiments.benchmark --mode=infer --variant=B/16 --image_size=224 --batch_size=16 \
        --precision=float32 --jit=auto --compare=keras_hub,timm
    python -m experiments.benchmark --mode=train --variant=S/16
    python -m experiments.benchmark --mode=profile --variant=B/16
    python -m experiments.benchmark --mode=train_profile --variant=S/16
    python -m experiments.benchmark --mode=patch_projection --variant=B/16 --batch_size=16
    python -m experiments.benchmark --mode=serving --variant=Ti/16 --image_size=224
    python -m experiments.benchmark --mode=input --image_size=224 --batch_size=64 [--randaugment=2,10] \
        [--data=PATH|tfds:NAME [--data_dir=DIR]]

`infer` / `train`: images per second of Keras `predict` (inference) or of
`fit` steps (training: AdamW, sparse cross-entropy) on in-memory data, after a
warm-up call, as the median over --repeats repetitions of --steps batches each;
the implementations take turns within every repetition so that they share the
machine's state. For each it prints the model's FLOPs per image
(`keras_vit.flops`; 3x forward for a training step), the achieved FLOP/s and
their fraction of the matmul peak: a 2048^3 matmul (8192^3 on a GPU or TPU)
at the same precision timed in the same process before and after the
repetitions, with and without XLA, the faster counting (on an accelerator,
that fraction is the MFU).
With --compare, the same architecture from keras-hub (with and without XLA;
ours is compared with its faster) and timm (PyTorch eager, in a child
process, on the GPU when the backend computes on one) is measured too, with
the ratios ours / peer. The peers are the optional `bench` extra. These modes
and `attention` also run on the JAX backend without TensorFlow installed
(`KERAS_BACKEND=jax`); the others need TensorFlow.

`attention`: the model's forward pass (compiled: XLA on JAX, a tf.function
with --jit's choice on TensorFlow) with attention as
`keras.ops.dot_product_attention` (cuDNN's fused attention on an NVIDIA GPU
under JAX) and as explicit batched matmuls and softmax: the largest
difference between their outputs, and each one's time, interleaved, median of
--repeats; on JAX, whether the compiled programs call a cuDNN attention kernel,
and the largest difference of the two forms' training-mode weight gradients.

`profile`: where an inference batch's time goes without XLA, per TensorFlow op
type (oneDNN's fused matmuls, batched matmuls of the attention, element-wise
ops), with the achieved FLOP/s of the whole batch.

`train_profile`: where an XLA-compiled training step's time goes (TensorFlow,
float32; the step `fit` runs): each op of the compiled program, timed by the
profiler, grouped into matmuls (dot and convolution, alone or fused) and, by
the layer each op came from, the rest; with the matmuls' GFLOP/s against the
matmul peaks measured in the same process, and the step time the matmuls
alone would take at each peak.

`patch_projection`: the patch embedding as a strided conv versus patch cutting
plus one matmul (`PatchEncoder(projection=...)`), same weights, with and
without XLA; repetitions are interleaved and the median is reported, with the
ratio conv / matmul (> 1 means the conv is faster).

`serving`: file size and single-image latency (median of --repeats, after
warm-up) of the Keras model (a tf.function), its SavedModel signature and each
TFLite flavour (float32, float16, dynamic-range, int8; LiteRT interpreter with
as many threads as cores), with each one's ratio to the Keras model.

`input`: images per second this host's training input pipeline delivers
(`keras_vit.data.training_pipeline`, what the job feeds `fit`: read, decode
with failures skipped, Inception crop, flip, optional RandAugment, uint8
batches at --image_size), with the CPU time per image and how many cores were
busy; the median of --repeats repetitions of --input_images images after a
warm-up pass.  The data: --data (an image folder, local or gs://, or
tfds:NAME[:SPLIT] with --data_dir), else a folder of --synthetic_images JPEGs
of --synthetic_size written to a temporary folder.  Compare its rate with
`--mode=train` at the same image size: the slower of the two sets the pace.
"""

import functools
import os
import platform
import statistics
import tempfile
import time

import keras
import numpy as np
from absl import app, flags

try:
    import tensorflow as tf
except ImportError:  # The JAX or PyTorch backend without TensorFlow: infer, train and attention.
    tf = None

import keras_vit
from keras_vit import kernels
from keras_vit.testing import (
    BATCHED_MATMULS,
    MATMULS,
    hlo_instructions,
    randomize_weights,
    step_part,
    traced_op_times,
)

_MODE = flags.DEFINE_enum(
    "mode",
    "infer",
    ["infer", "train", "attention", "profile", "train_profile", "patch_projection", "serving", "input"],
    "What to measure.",
)
_VARIANT = flags.DEFINE_string("variant", "B/16", "ViT variant, e.g. B/16.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Square image size in pixels.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 16, "Images per batch.")
_REPEATS = flags.DEFINE_integer(
    "repeats",
    None,
    "Timed repetitions (default: 5 for infer, train, profile, train_profile and input, 30 for the others).",
)
_STEPS = flags.DEFINE_integer("steps", 2, "infer/train: batches per timed repetition.")
_PRECISION = flags.DEFINE_enum(
    "precision", "float32", ["float32", "mixed_bfloat16"], "infer/train: Keras dtype policy."
)
_JIT = flags.DEFINE_enum(
    "jit", "auto", list(keras_vit.training.JIT_COMPILE), "infer/train: XLA for keras_vit."
)
_COMPARE = flags.DEFINE_list(
    "compare", [], "infer/train: peers to measure, of keras_hub,timm,timm_compiled (timm with torch.compile)."
)
PEERS = ("keras_hub", "timm", "timm_compiled")
_DATA = flags.DEFINE_string(
    "data", "", "input: an image folder (local or gs://) or tfds:NAME[:SPLIT]; default: synthetic JPEGs."
)
_DATA_DIR = flags.DEFINE_string("data_dir", "", "input: the TFDS data_dir of --data=tfds:NAME.")
_SYNTHETIC_IMAGES = flags.DEFINE_integer("synthetic_images", 512, "input: JPEGs in the synthetic folder.")
_SYNTHETIC_SIZE = flags.DEFINE_string(
    "synthetic_size", "500x375", "input: WIDTHxHEIGHT of the synthetic JPEGs (500x375: a typical ImageNet photo)."
)
_RANDAUGMENT = flags.DEFINE_list("randaugment", [], "input: RandAugment NUM_OPS,MAGNITUDE, e.g. 2,10; none if empty.")
_INPUT_IMAGES = flags.DEFINE_integer("input_images", 1024, "input: images per timed repetition.")
_TIMM_PYTHON = flags.DEFINE_string(
    "timm_python", "", "infer/train: the Python that runs the timm peers (default: this one), where PyTorch lives apart."
)
_FLOAT32_ROW = flags.DEFINE_boolean(
    "float32_row", True, "infer/train with a 16-bit --precision: also measure our float32 model (the 16-bit speed-up)."
)


# A pause before each timed call, so that no thread pool of the previous one
# (TensorFlow's, XLA's, PyTorch's OpenMP threads in the timm worker) still
# spins on the cores.
SETTLE_SECONDS = 0.5


def time_calls(functions, inputs, repeats):
    """Median seconds per call of each function, calls interleaved, after warm-up."""
    for fn in functions.values():
        for _ in range(3):
            timed(fn, inputs)
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            times[name].append(timed(fn, inputs))
    return {name: statistics.median(ts) for name, ts in times.items()}


def timed(function, argument):
    """Seconds of one call, until its result is computed.

    A JAX array is waited for where it is (an accelerator's result can be
    larger than the call's own time to copy back); others are brought to the
    host.
    """
    start = time.perf_counter()
    result = function(argument)
    if hasattr(result, "block_until_ready"):
        result.block_until_ready()
    else:
        keras.ops.convert_to_numpy(result)
    return time.perf_counter() - start


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


# === infer / train ===


def machine_name():
    """The accelerator the backend computes on, else the CPU's model name."""
    if keras.backend.backend() == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform != "cpu":
            return f"{jax.device_count()} x {device.device_kind} ({device.platform})"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _square(a):
    return a @ a


def matmul_peak_functions(dtype, size):
    """{name: (function, its input)} each running one size^3 matmul at `dtype`; FLOPs per call."""
    if keras.backend.backend() == "tensorflow":
        a = tf.cast(tf.random.stateless_normal((size, size), seed=(0, 0)), dtype)
        functions = {
            f"matmul {'XLA' if jit else 'no XLA'}": (
                tf.function(_square, jit_compile=jit, autograph=False),
                a,
            )
            for jit in (False, True)
        }
    elif keras.backend.backend() == "jax":  # JAX compiles everything with XLA.
        import jax

        a = jax.numpy.asarray(np.random.default_rng(0).normal(size=(size, size)), dtype)
        functions = {"matmul XLA": (jax.jit(_square), a)}
    else:
        a = keras.ops.convert_to_tensor(np.random.default_rng(0).normal(size=(size, size)), dtype)
        functions = {"matmul": (_square, a)}
    return functions, 2 * size**3


def matmul_peak_rates(matmuls, matmul_flops):
    """{name: [FLOP/s]} of each `matmul_peak_functions` entry: three rates, each its best of three calls."""
    return {
        name: [matmul_flops / min(timed(function, argument) for _ in range(3)) for _ in range(3)]
        for name, (function, argument) in matmuls.items()
    }


def keras_contender(model, mode, images, labels, batch_size, jit_compile):
    """A function (steps -> seconds) running `predict` or `fit` on `steps` batches.

    On TensorFlow the batches come from a tf.data pipeline over tensors
    already in memory, the input a TensorFlow user gives `fit`; NumPy arrays
    would add Keras' per-call array slicing pipeline to every call.
    On the other backends they are backend tensors made once, so an
    accelerator's batches are already on it (as timm's are in its worker).
    """
    if mode == "train":
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
    else:
        model.compile(jit_compile=jit_compile)
    if keras.backend.backend() == "tensorflow":
        # tf.data's autotuning is off: with it on, deleting the iterator at the
        # end of a `predict` or `fit` call (each timed call makes one) can block
        # for a large part of a small model's call, a cost of the harness, not
        # of the model, that timm's loop does not pay. The batches are in
        # memory either way.
        options = tf.data.Options()
        options.autotune.enabled = False
        data = (
            tf.data.Dataset.from_tensor_slices(
                (tf.constant(images), tf.constant(labels)) if mode == "train" else tf.constant(images)
            )
            .batch(batch_size, drop_remainder=True)
            .with_options(options)
        )

        def inputs(steps):
            return {"x": data.take(steps)}
    else:
        x, y = keras.ops.convert_to_tensor(images), keras.ops.convert_to_tensor(labels)

        def inputs(steps):
            batch = {"x": x[: steps * batch_size], "batch_size": batch_size}
            if mode == "train":
                batch.update(y=y[: steps * batch_size], shuffle=False)
            return batch

    def run(steps):
        start = time.perf_counter()
        if mode == "train":
            model.fit(epochs=1, verbose=0, **inputs(steps))
        else:
            model.predict(verbose=0, **inputs(steps))
        return time.perf_counter() - start

    return run


def throughput(variant, image_size, batch_size, mode, precision, jit, compare, repeats, steps, float32_row=True):
    """Measures and prints images/s, FLOP/s and ratios; returns {name: images/s}."""
    from experiments import peers

    unknown = sorted(set(compare) - set(PEERS))
    if unknown:
        raise SystemExit(f"--compare takes a subset of {list(PEERS)}. Received: {unknown}")
    num_classes = 1000
    accelerator = keras_vit.training.accelerator()
    config = keras_vit.parse_variant(variant)
    flops = keras_vit.flops.count_flops(
        variant, image_size=image_size, num_classes=num_classes, training=mode == "train"
    )
    keras.mixed_precision.set_dtype_policy(precision)
    jit_compile = keras_vit.training.resolve_jit_compile(jit, precision, training=mode == "train")
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (steps * batch_size, image_size, image_size, 3)).astype("float32")
    labels = rng.integers(0, num_classes, steps * batch_size)

    # === Contenders: name -> (steps -> seconds), parameter count; peer -> its contenders' names ===
    contenders, peer_names = {}, {peer: [] for peer in compare}

    def add_keras(label, model, jit_compile):
        name = f"{label} ({'XLA' if jit_compile else 'no XLA'})"
        run = keras_contender(model, mode, images, labels, batch_size, jit_compile)
        contenders[name] = (run, model.count_params())
        return name

    ours_name = add_keras(
        "keras_vit", keras_vit.build_vit(variant, image_size=image_size, num_classes=num_classes), jit_compile
    )
    measure_float32 = float32_row and precision != "float32"
    if measure_float32:  # Our own float32 model, for the speed-up of the 16-bit policy.
        keras.mixed_precision.set_dtype_policy("float32")
        ours32 = keras_vit.build_vit(variant, image_size=image_size, num_classes=num_classes)
        keras.mixed_precision.set_dtype_policy(precision)
        jit32 = keras_vit.training.resolve_jit_compile(jit, "float32", training=mode == "train")
        float32_name = add_keras("keras_vit float32", ours32, jit32)
    workers = []
    if "keras_hub" in compare:
        # Without XLA is TensorFlow's graph mode; the JAX backend always compiles.
        for hub_jit in (False, True) if keras.backend.backend() == "tensorflow" else (True,):
            hub = peers.keras_hub_model(config, image_size, num_classes, precision)
            peer_names["keras_hub"].append(add_keras("keras_hub", hub, hub_jit))
    device = "cuda" if accelerator == "gpu" else "cpu"
    tf32 = ", TF32" if device == "cuda" and precision == "float32" else ""
    for peer, compiled, label in (("timm", False, "PyTorch eager"), ("timm_compiled", True, "torch.compile")):
        if peer in compare:
            worker = peers.TimmWorker(
                config, image_size, batch_size, num_classes, mode, precision, device, compiled=compiled,
                python=_TIMM_PYTHON.value or None, passive_threads={"timm", "timm_compiled"} <= set(compare),
            )  # fmt: skip
            workers.append(worker)
            name = f"timm ({label}, {device}{tf32})"
            contenders[name] = (worker, worker.parameters)
            peer_names[peer].append(name)
    dtype = "bfloat16" if precision == "mixed_bfloat16" else "float32"
    # An accelerator needs a larger product to reach its peak than a CPU core.
    matmul_size = 2048 if accelerator == "cpu" else 8192
    matmuls, matmul_flops = matmul_peak_functions(dtype, matmul_size)

    # === Matmul peak, warm-up (compilation), interleaved repetitions, matmul peak ===
    # The peak is timed before and after the repetitions, not between them:
    # on the CPU the calls that follow the large matmuls run slower for a
    # while (seen on JAX with a small model).
    try:
        for function, argument in matmuls.values():
            timed(function, argument)
        peaks = matmul_peak_rates(matmuls, matmul_flops)
        for run, _ in contenders.values():
            run(1)
        rates = {name: [] for name in contenders}
        names = list(contenders)
        for repeat in range(repeats):  # Each repetition starts with the next contender.
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                time.sleep(SETTLE_SECONDS)
                rates[name].append(steps * batch_size / contenders[name][0](steps))
        for name, values in matmul_peak_rates(matmuls, matmul_flops).items():
            peaks[name] += values
    finally:
        for worker in workers:
            worker.close()
    peak_by_kind = {name: statistics.median(values) for name, values in peaks.items()}
    peak = max(peak_by_kind.values())
    median = {name: statistics.median(values) for name, values in rates.items()}

    # === Report ===
    what = "training steps (fit, AdamW)" if mode == "train" else "inference (predict)"
    print(
        f"{variant} {what} at {image_size} px, batch {batch_size}, {precision}, "
        f"--jit={jit} ({'XLA' if jit_compile else 'no XLA'} for keras_vit), backend {keras.backend.backend()}"
    )
    print(
        f"Machine: {machine_name()}, {os.cpu_count()} CPU cores. Median of {repeats} interleaved "
        f"repetitions of {steps} batches each, after a warm-up."
    )
    print(
        f"Model FLOPs per image: {flops / 1e9:.6f} G ({'3x forward' if mode == 'train' else 'forward'}; "
        f"matmuls and convolutions, multiply-add = 2)"
    )
    print(
        f"Matmul peak ({dtype} {matmul_size}^3): "
        + ", ".join(f"{name} {value / 1e9:.0f} GFLOP/s" for name, value in peak_by_kind.items())
        + f"; roofline {peak / 1e9:.0f} GFLOP/s"
    )
    print(f"  {'implementation':34s} {'params':>11s} {'images/s':>9s} {'GFLOP/s':>8s} {'of peak':>8s} {'ours/this':>9s}")
    for name, rate in median.items():
        print(
            f"  {name:34s} {contenders[name][1]:11,d} {rate:9.2f} {rate * flops / 1e9:8.1f} "
            f"{100 * rate * flops / peak:7.1f}% {median[ours_name] / rate:8.2f}x"
        )
    if measure_float32:
        print(f"keras_vit {precision} / keras_vit float32: {median[ours_name] / median[float32_name]:.2f}x")
    for peer, names in peer_names.items():
        best = max((median[name], name) for name in names)
        faster = ", its faster" if len(names) > 1 else ""
        print(f"keras_vit / {peer}: {median[ours_name] / best[0]:.2f}x (against {best[1]}{faster})")
    return median


# === attention ===


def random_model(variant, image_size):
    """The variant with 1000 classes and every weight drawn from N(0, 0.02): zero
    biases would be constant-folded away, and identical outputs could hide a
    wrong path."""
    model = keras_vit.build_vit(variant, image_size=image_size, num_classes=1000)
    return randomize_weights(model, scale=0.02, unit_scales=False)


def compiled_forward(model, jit_compile):
    """A function images -> logits running `model`'s inference forward pass compiled."""
    if keras.backend.backend() == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        fixed = [v.value for v in model.non_trainable_variables]
        forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0])
        function = functools.partial(forward, trainable, fixed)
        function.lowered = lambda x: forward.lower(trainable, fixed, x)
        return function
    if keras.backend.backend() == "tensorflow":
        return tf.function(lambda x: model(x, training=False), jit_compile=jit_compile)
    return lambda x: model(x, training=False)


def _uses_cudnn_attention(program):
    """Whether a compiled program's text calls one of cuDNN's fused attention kernels."""
    return "cudnn" in program and ("fmha" in program or "fused_attention" in program)


def training_gradients(model, images):
    """On JAX: a jitted function () -> (loss, gradients of the trainable weights) of a training-mode
    forward pass (mean of the logits times fixed weights), and its compiled program's text."""
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]
    weights = jnp.asarray(np.random.default_rng(2).normal(size=model.output_shape[1:]), "float32")

    def loss(trainable, x):
        logits, _ = model.stateless_call(trainable, fixed, x, training=True)
        return jnp.mean(logits.astype("float32") * weights)

    function = jax.jit(jax.value_and_grad(loss))
    return functools.partial(function, trainable), function.lower(trainable, images).compile().as_text()


def attention(variant, image_size, batch_size, precision, jit, repeats):
    """Fused vs explicit attention in the whole model; returns (max |difference|, {form: seconds}).

    On JAX it also compares a training-mode gradient of the weights, the fused form's backward pass."""
    keras.mixed_precision.set_dtype_policy(precision)
    model = random_model(variant, image_size)
    jit_compile = keras_vit.training.resolve_jit_compile(jit, precision, training=False)
    rng = np.random.default_rng(1)
    images = keras.ops.convert_to_tensor(
        rng.uniform(0, 255, (batch_size, image_size, image_size, 3)).astype("float32")
    )
    functions, outputs, cudnn, gradients = {}, {}, {}, {}
    for form, fused in (("fused", True), ("explicit", False)):
        function = compiled_forward(model, jit_compile)
        with kernels.fused_attention(fused):  # Traced here, on the first call.
            outputs[form] = keras.ops.convert_to_numpy(function(images)).astype("float32")
            if hasattr(function, "lowered"):
                cudnn[form] = _uses_cudnn_attention(function.lowered(images).compile().as_text())
                gradient, program = training_gradients(model, images)
                gradients[form] = [np.asarray(g, "float32") for g in gradient(images)[1]]
                cudnn[f"{form} training"] = _uses_cudnn_attention(program)
        functions[form] = function
    medians = time_calls(functions, images, repeats)
    difference = float(np.max(np.abs(outputs["fused"] - outputs["explicit"])))
    print(
        f"{variant} inference at {image_size} px, batch {batch_size}, {precision}, backend "
        f"{keras.backend.backend()} on {machine_name()}, {'XLA' if jit_compile else 'no XLA'}"
    )
    print(
        f"Largest |fused - explicit| of the logits: {difference:.3g} "
        f"(largest |logit| {float(np.max(np.abs(outputs['explicit']))):.3g})"
    )
    if gradients:
        relative = max(
            float(np.max(np.abs(f - e)) / max(float(np.max(np.abs(e))), 1e-30))
            for f, e in zip(gradients["fused"], gradients["explicit"])
        )
        print(
            f"Training-mode weight gradients, largest |fused - explicit| / largest |explicit| of a weight: "
            f"{relative:.3g}; cuDNN attention kernel in the training program: fused "
            f"{'yes' if cudnn['fused training'] else 'no'}, explicit {'yes' if cudnn['explicit training'] else 'no'}"
        )
    for form, seconds in medians.items():
        kernel = f", cuDNN attention kernel: {'yes' if cudnn[form] else 'no'}" if form in cudnn else ""
        print(f"  {form:9s} {1000 * seconds:9.2f} ms  {batch_size / seconds:10.1f} images/s{kernel}")
    print(f"fused / explicit speed: {medians['explicit'] / medians['fused']:.2f}x")
    return difference, medians


# === profile ===


def profile(variant, image_size, batch_size, precision, repeats):
    """Time per TensorFlow op type of one inference batch, as oneDNN runs it (no XLA).

    Returns {op type: seconds per batch}, the mean of `repeats` traced runs
    (see `traced_op_times`).
    """
    import collections

    keras.mixed_precision.set_dtype_policy(precision)
    model = random_model(variant, image_size)
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (batch_size, image_size, image_size, 3)).astype("float32")
    seconds = collections.Counter()
    for op, value in traced_op_times(lambda x: model(x, training=False), images, repeats):
        seconds[op] += value / repeats
    total = sum(seconds.values())
    flops = keras_vit.flops.count_flops(variant, image_size=image_size) * batch_size
    print(
        f"{variant} inference at {image_size} px, batch {batch_size}, {precision}, no XLA: time per op "
        f"type, mean of {repeats} traced runs; {total:.3f} s of op time per batch, "
        f"{flops / total / 1e9:.0f} GFLOP/s"
    )
    for op, value in seconds.most_common():
        if value >= 0.001 * total:
            print(f"  {op:28s} {1000 * value:9.1f} ms {100 * value / total:6.1f}%")
    return seconds


# === train_profile ===

def _profiled_event_seconds(function, argument, repeats):
    """{event name: seconds} of `repeats` calls of `function` under TensorFlow's profiler."""
    import collections
    import glob

    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError as error:
        raise SystemExit(f"--mode=train_profile reads TensorFlow's profiler output: {error}")
    seconds = collections.Counter()
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(repeats):
                timed(function, argument)
        finally:
            tf.profiler.experimental.stop()
        for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
            space = xplane_pb2.XSpace()
            with open(path, "rb") as f:
                space.ParseFromString(f.read())
            for plane in space.planes:
                for line in plane.lines:
                    for event in line.events:
                        seconds[plane.event_metadata[event.metadata_id].name] += event.duration_ps / 1e12
    return seconds


def train_profile(variant, image_size, batch_size, repeats):
    """Op time per part of an XLA-compiled float32 training step; returns {part: seconds per step}."""
    import collections

    keras.mixed_precision.set_dtype_policy("float32")
    model = keras_vit.build_vit(variant, image_size=image_size, num_classes=1000)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    batch = (
        tf.constant(rng.uniform(0, 255, (batch_size, image_size, image_size, 3)).astype("float32")),
        tf.constant(rng.integers(0, 1000, batch_size)),
    )
    step = tf.function(model.train_step, jit_compile=True)
    instructions = hlo_instructions(step.experimental_get_compiler_ir(batch)(stage="optimized_hlo"))
    seconds_per_step = statistics.median(timed(step, batch) for _ in range(repeats + 1))
    events = _profiled_event_seconds(step, batch, repeats)

    parts = collections.Counter()
    for name, seconds in events.items():
        if name not in instructions:
            continue  # The runtime's own events (executor, thunk executor, tf.data).
        parts[step_part(*instructions[name])] += seconds / repeats
    if not parts:
        raise SystemExit(
            "The profile holds no op of the compiled step: this TensorFlow's XLA records none "
            "(XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true asks it to)."
        )
    total = sum(parts.values())
    attention_seconds = parts[BATCHED_MATMULS]
    matmul_seconds = parts[MATMULS] + attention_seconds
    flops = keras_vit.flops.count_flops(variant, image_size=image_size, training=True) * batch_size
    # Logits and attention-weighted values: 2 x 2 x tokens^2 x width per layer, 3x for a step.
    blocks = [layer for layer in model.layers if isinstance(layer, keras_vit.layers.TransformerBlock)]
    tokens, width = blocks[0].input.shape[1:]  # build_vit always makes at least one block.
    attention_flops = 3 * batch_size * len(blocks) * 4 * tokens**2 * width

    def rate(flops, seconds):
        return f"{flops / seconds / 1e9:.0f} GFLOP/s" if seconds > 0 else "n/a (no op timed)"

    matmuls, matmul_flops = matmul_peak_functions("float32", 2048)
    for function, argument in matmuls.values():
        timed(function, argument)
    rates = matmul_peak_rates(matmuls, matmul_flops)
    peaks = {name: statistics.median(values) for name, values in rates.items()}
    print(
        f"{variant} training step (AdamW) at {image_size} px, batch {batch_size}, float32, XLA: "
        f"{seconds_per_step:.3f} s per step ({batch_size / seconds_per_step:.2f} images/s, median of "
        f"{repeats + 1}); op time per part, mean of {repeats} profiled steps: {total:.3f} s"
    )
    for part, value in parts.most_common():
        print(f"  {part:48s} {1000 * value:9.1f} ms {100 * value / total:6.1f}%")
    print(
        f"Matmuls: {flops / 1e9:.1f} GFLOP per step at {rate(flops, matmul_seconds)} (projections etc. "
        f"{(flops - attention_flops) / 1e9:.3g} GFLOP at {rate(flops - attention_flops, parts[MATMULS])}, "
        f"attention {attention_flops / 1e9:.3g} GFLOP at {rate(attention_flops, attention_seconds)}); "
        "peak (float32 2048^3) "
        + ", ".join(f"{name} {value / 1e9:.0f} GFLOP/s" for name, value in peaks.items())
    )
    rest = total - matmul_seconds
    for name, value in peaks.items():
        alone = flops / value
        print(
            f"At the {name} peak the matmuls alone take {alone:.3f} s per step ({batch_size / alone:.2f} "
            f"images/s); with the rest as profiled, {alone + rest:.3f} s ({batch_size / (alone + rest):.2f} "
            "images/s)"
        )
    return parts


# === input ===


def write_synthetic_folder(root, count, size, seed=0):
    """`count` JPEGs (quality 90) of `size` (width, height) in two class folders: smooth gradients
    and noise, which encode to about 100 KB at 500x375, as ImageNet's photos do."""
    width, height = size
    rng = np.random.default_rng(seed)
    rows, columns = np.mgrid[0:height, 0:width]
    for i in range(count):
        folder = os.path.join(root, f"class{i % 2}")
        os.makedirs(folder, exist_ok=True)
        base = np.stack([columns * (i % 7 + 1), rows * (i % 5 + 1), columns + rows + 20 * i], -1) % 256
        image = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        with open(os.path.join(folder, f"{i}.jpg"), "wb") as f:
            f.write(tf.io.encode_jpeg(image, quality=90).numpy())
    return root


def input_rate(source, image_size, batch_size, randaugment, repeats, images_per_repeat, what):
    """Measures and prints the training input pipeline's images/s; returns the median."""
    from keras_vit import data as vit_data

    ds = vit_data.training_pipeline(source, image_size, batch_size, randaugment=randaugment)
    batches = iter(ds)
    per_repeat = -(-images_per_repeat // batch_size)
    for _ in range(-(-source.num_train // batch_size)):  # Warm-up: a pass over the files.
        next(batches)
    rates, cpu_per_image, busy = [], [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(per_repeat):
            next(batches)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        rates.append(per_repeat * batch_size / seconds)
        cpu_per_image.append(cpu_seconds / (per_repeat * batch_size))
        busy.append(cpu_seconds / seconds)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rate = statistics.median(rates)
    augment = "Inception crop, flip" + (f", RandAugment{tuple(randaugment)}" if randaugment else "")
    print(
        f"Input pipeline ({what}; read, decode, {augment}) at {image_size} px, batch {batch_size}, "
        f"on {machine_name()}: median of {repeats} repetitions of {per_repeat * batch_size} images after a "
        "warm-up pass"
    )
    print(
        f"  {rate:.1f} images/s per host, {1000 * statistics.median(cpu_per_image):.2f} ms of CPU per image, "
        f"{statistics.median(busy):.1f} of {cores} cores busy (tf.data AUTOTUNE: parallel calls up to "
        f"{cores} per map)"
    )
    if source.skipped.count:
        print(f"  {source.skipped.count} image(s) skipped: failed to decode, e.g. {source.skipped.paths[:3]}")
    print(f"  Compare: --mode=train --image_size={image_size} gives the model's images/s on this host.")
    return rate


def input_benchmark(image_size, batch_size, repeats):
    from keras_vit import data as vit_data

    if _RANDAUGMENT.value and len(_RANDAUGMENT.value) != 2:
        raise SystemExit(f"--randaugment takes NUM_OPS,MAGNITUDE. Received: {_RANDAUGMENT.value}")
    randaugment = tuple(int(v) for v in _RANDAUGMENT.value) or None
    with tempfile.TemporaryDirectory() as tmp:
        data = _DATA.value
        if data.startswith("tfds:"):
            what = data
        else:
            if not data:
                size = tuple(int(v) for v in _SYNTHETIC_SIZE.value.lower().split("x"))
                data = write_synthetic_folder(tmp, _SYNTHETIC_IMAGES.value, size)
                what = f"{_SYNTHETIC_IMAGES.value} synthetic {_SYNTHETIC_SIZE.value} JPEGs"
            else:
                what = f"folder {data}"
            data = f"folder:{data}"
        source = vit_data.load_image_source(data, data_dir=_DATA_DIR.value or None, test_fraction=0.1)
        return input_rate(source, image_size, batch_size, randaugment, repeats, _INPUT_IMAGES.value, what)


def main(argv):
    del argv
    keras.utils.set_random_seed(0)
    mode = _MODE.value
    if tf is None and mode not in ("infer", "train", "attention"):
        raise SystemExit(
            f"--mode={mode} needs TensorFlow; without it --mode=infer, train and attention run."
        )
    if mode == "train_profile":
        # XLA's CPU runtime names each op of the compiled program to the profiler only when asked;
        # it reads the flags when it first compiles, which is after this.
        flags_now = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags_now} --xla_cpu_enable_xprof_traceme=true".strip()
    repeats = _REPEATS.value or (5 if mode in ("infer", "train", "profile", "train_profile", "input") else 30)
    if mode in ("infer", "train"):
        throughput(
            _VARIANT.value, _IMAGE_SIZE.value, _BATCH_SIZE.value, mode, _PRECISION.value,
            _JIT.value, _COMPARE.value, repeats, _STEPS.value, _FLOAT32_ROW.value,
        )  # fmt: skip
    elif mode == "attention":
        attention(_VARIANT.value, _IMAGE_SIZE.value, _BATCH_SIZE.value, _PRECISION.value, _JIT.value, repeats)
    elif mode == "profile":
        profile(_VARIANT.value, _IMAGE_SIZE.value, _BATCH_SIZE.value, _PRECISION.value, repeats)
    elif mode == "train_profile":
        train_profile(_VARIANT.value, _IMAGE_SIZE.value, _BATCH_SIZE.value, repeats)
    elif mode == "patch_projection":
        patch_projection(_VARIANT.value, _IMAGE_SIZE.value, _BATCH_SIZE.value, repeats)
    elif mode == "serving":
        serving(_VARIANT.value, _IMAGE_SIZE.value, repeats)
    elif mode == "input":
        input_benchmark(_IMAGE_SIZE.value, _BATCH_SIZE.value, repeats)


if __name__ == "__main__":
    app.run(main)
