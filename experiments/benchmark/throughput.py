"""`--mode=infer` and `--mode=train`: images per second of Keras `predict` or `fit`, ours and the peers'.

The implementations take turns within every repetition so that they share the
machine's state; the matmul peak at the same precision is timed in the same
process before and after the repetitions (see `timing`).
"""

import dataclasses
import os
import statistics
import time

import keras
import numpy as np

import keras_vit
from experiments.benchmark import peers
from experiments.benchmark.timing import (
    SETTLE_SECONDS,
    machine_name,
    matmul_peak_functions,
    matmul_peak_rates,
    median_peaks,
    timed,
)

NUM_CLASSES = 1000


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
        import tensorflow as tf

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


@dataclasses.dataclass
class Contenders:
    """The implementations one benchmark times, in the order they take turns.

    `runs`: name -> (steps -> seconds, parameter count); `peer_names`: peer -> the names of its forms;
    `workers`: the peers' processes, closed after the timing; `ours`, `unquantized` and `float32`: the names
    of our model and of the baselines it is compared with (None when not measured).
    """

    mode: str
    images: np.ndarray
    labels: np.ndarray
    batch_size: int
    peer_names: dict
    runs: dict = dataclasses.field(default_factory=dict)
    workers: list = dataclasses.field(default_factory=list)
    ours: str = ""
    unquantized: str | None = None
    float32: str | None = None

    def add_keras(self, label, model, jit_compile):
        """Adds a Keras model's `predict` or `fit` under "LABEL (XLA | no XLA)"; returns that name."""
        name = f"{label} ({'XLA' if jit_compile else 'no XLA'})"
        run = keras_contender(model, self.mode, self.images, self.labels, self.batch_size, jit_compile)
        self.runs[name] = (run, model.count_params())
        return name

    def close(self):
        for worker in self.workers:
            worker.close()


def add_ours(contenders, variant, image_size, precision, jit, jit_compile, quantize, float32_row):
    """Adds our model, and the baselines of its speed-ups: the same weights unquantized (with `quantize`) and
    our float32 model (with a 16-bit `precision` and `float32_row`)."""
    ours = keras_vit.build_vit(variant, image_size=image_size, num_classes=NUM_CLASSES)
    if quantize:  # The same weights unquantized, then quantized: the quantization's speed-up.
        unquantized = keras_vit.build_vit(variant, image_size=image_size, num_classes=NUM_CLASSES)
        unquantized.set_weights(ours.get_weights())
        contenders.unquantized = contenders.add_keras("keras_vit unquantized", unquantized, jit_compile)
        ours.quantize(quantize)
    contenders.ours = contenders.add_keras(f"keras_vit {quantize}" if quantize else "keras_vit", ours, jit_compile)
    if float32_row and precision != "float32":  # Our own float32 model, for the speed-up of the 16-bit policy.
        keras.mixed_precision.set_dtype_policy("float32")
        ours32 = keras_vit.build_vit(variant, image_size=image_size, num_classes=NUM_CLASSES)
        keras.mixed_precision.set_dtype_policy(precision)
        jit32 = keras_vit.training.resolve_jit_compile(jit, "float32", training=contenders.mode == "train")
        contenders.float32 = contenders.add_keras("keras_vit float32", ours32, jit32)


def add_peers(contenders, config, image_size, precision, compare, timm_python, accelerator):
    """Adds the peers named in `compare`: keras-hub's ViT (with and without XLA on TensorFlow) and timm's,
    eager and compiled, each in a worker process."""
    if "keras_hub" in compare:
        # Without XLA is TensorFlow's graph mode; the JAX backend always compiles.
        for hub_jit in (False, True) if keras.backend.backend() == "tensorflow" else (True,):
            hub = peers.keras_hub_model(config, image_size, NUM_CLASSES, precision)
            contenders.peer_names["keras_hub"].append(contenders.add_keras("keras_hub", hub, hub_jit))
    device = "cuda" if accelerator == "gpu" else "cpu"
    tf32 = ", TF32" if device == "cuda" and precision == "float32" else ""
    for peer, compiled, label in (("timm", False, "PyTorch eager"), ("timm_compiled", True, "torch.compile")):
        if peer in compare:
            worker = peers.TimmWorker(
                config, image_size, contenders.batch_size, NUM_CLASSES, contenders.mode, precision, device,
                compiled=compiled, python=timm_python, passive_threads={"timm", "timm_compiled"} <= set(compare),
            )  # fmt: skip
            contenders.workers.append(worker)
            name = f"timm ({label}, {device}{tf32})"
            contenders.runs[name] = (worker, worker.parameters)
            contenders.peer_names[peer].append(name)


def time_interleaved(runs, matmuls, matmul_flops, repeats, steps, batch_size):
    """(matmul peaks, name -> images/s of each repetition): the matmul peak, a warm-up (compilation) of every
    run, `repeats` interleaved repetitions of `steps` batches, and the matmul peak again.

    The peak is timed before and after the repetitions, not between them: on the CPU the calls that follow
    the large matmuls run slower for a while (seen on JAX with a small model).
    """
    for function, argument in matmuls.values():
        timed(function, argument)
    peaks = matmul_peak_rates(matmuls, matmul_flops)
    for run, _ in runs.values():
        run(1)
    rates = {name: [] for name in runs}
    names = list(runs)
    for repeat in range(repeats):  # Each repetition starts with the next contender.
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            time.sleep(SETTLE_SECONDS)
            rates[name].append(steps * batch_size / runs[name][0](steps))
    for name, values in matmul_peak_rates(matmuls, matmul_flops).items():
        peaks[name] += values
    return peaks, rates


def print_table(contenders, median, flops, peak):
    """Prints each implementation's parameters, images/s, FLOP/s, fraction of the roofline and our speed-up."""
    print(
        f"  {'implementation':34s} {'params':>11s} {'images/s':>9s} {'GFLOP/s':>8s} {'of peak':>8s} "
        f"{'ours/this':>9s}"
    )
    for name, rate in median.items():
        print(
            f"  {name:34s} {contenders.runs[name][1]:11,d} {rate:9.2f} {rate * flops / 1e9:8.1f} "
            f"{100 * rate * flops / peak:7.1f}% {median[contenders.ours] / rate:8.2f}x"
        )


def speed_ups(contenders, median, precision, quantize):
    """Prints and returns {what: {"ratio": ours / it, "against": its name}} for the quantization, the 16-bit
    policy and each peer (against its faster form)."""
    ours = median[contenders.ours]
    ratios = {}
    if contenders.unquantized:
        ratios["quantized"] = {"ratio": ours / median[contenders.unquantized], "against": contenders.unquantized}
        print(f"keras_vit {quantize} / keras_vit unquantized: {ratios['quantized']['ratio']:.2f}x")
    if contenders.float32:
        ratios["float32"] = {"ratio": ours / median[contenders.float32], "against": contenders.float32}
        print(f"keras_vit {precision} / keras_vit float32: {ratios['float32']['ratio']:.2f}x")
    for peer, names in contenders.peer_names.items():
        best = max((median[name], name) for name in names)
        faster = ", its faster" if len(names) > 1 else ""
        ratios[peer] = {"ratio": ours / best[0], "against": best[1]}
        print(f"keras_vit / {peer}: {ratios[peer]['ratio']:.2f}x (against {best[1]}{faster})")
    return ratios


def throughput(
    variant, image_size, batch_size, mode, precision, jit, compare, repeats, steps, float32_row=True, timm_python=None,
    quantize=None,
):  # fmt: skip
    """Measures and prints images/s, FLOP/s and ratios.

    Returns {"figures", "ratios", "xla", "versions"} for a results row (`results.make_row`):
    figures hold each implementation's images/s and parameter count, the matmul peaks and the
    fraction of the roofline each reached; ratios are ours / each peer's faster form (and ours /
    our float32 model with a 16-bit precision).
    """
    peers.check_compare(compare, timm_python)
    accelerator = keras_vit.kernels.policy.device()
    config = keras_vit.parse_variant(variant)
    flops = keras_vit.flops.count_flops(
        variant, image_size=image_size, num_classes=NUM_CLASSES, training=mode == "train"
    )
    keras.mixed_precision.set_dtype_policy(precision)
    jit_compile = keras_vit.training.resolve_jit_compile(jit, precision, training=mode == "train")
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (steps * batch_size, image_size, image_size, 3)).astype("float32")
    labels = rng.integers(0, NUM_CLASSES, steps * batch_size)

    contenders = Contenders(mode, images, labels, batch_size, {peer: [] for peer in compare})
    add_ours(contenders, variant, image_size, precision, jit, jit_compile, quantize, float32_row)
    add_peers(contenders, config, image_size, precision, compare, timm_python, accelerator)
    dtype = "bfloat16" if precision == "mixed_bfloat16" else "float32"
    # An accelerator needs a larger product to reach its peak than a CPU core.
    matmul_size = 2048 if accelerator == "cpu" else 8192
    matmuls, matmul_flops = matmul_peak_functions(dtype, matmul_size)
    try:
        peaks, rates = time_interleaved(contenders.runs, matmuls, matmul_flops, repeats, steps, batch_size)
    finally:
        contenders.close()
    peak_by_kind = median_peaks(peaks)
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
    print_table(contenders, median, flops, peak)
    ratios = speed_ups(contenders, median, precision, quantize)
    figures = {
        "ours": contenders.ours,
        "images_per_second": median,
        "params": {name: contender[1] for name, contender in contenders.runs.items()},
        "of_peak": {name: rate * flops / peak for name, rate in median.items()},
        "model_flops_per_image": flops,
        "matmul_peak": {"matmul": f"{dtype} {matmul_size}^3", "flops_per_second": peak_by_kind},
        "peak_flops_per_second": peak,
    }
    versions = {}
    for worker in contenders.workers:  # The peers' own interpreter may not be this one (--timm_python).
        versions.update(worker.versions)
    return {"figures": figures, "ratios": ratios, "xla": jit_compile, "versions": versions}
