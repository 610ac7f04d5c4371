"""`--mode=peaks`: the machine's matmul throughput at the model's shapes, in each precision and runtime.

The four weight matmuls of a block (query-key-value, the attention's output, the MLP's two) at `batch_size`
images: (batch x tokens, hidden) times (hidden, 3 hidden), (hidden, hidden), (hidden, mlp) and (mlp, hidden).
Each is timed alone, the weights fixed and the activations given, in

- TensorFlow, graph (oneDNN where TensorFlow runs it): float32, bfloat16, and int8 as oneDNN's u8 x s8 matmul
  (`QuantizedMatMulWithBiasAndDequantize`, what `export_saved_model(precision="int8")` runs);
- TensorFlow under XLA: float32, bfloat16, int8 (an int8 x int8 -> int32 dot);
- LiteRT (XNNPACK): one FULLY_CONNECTED op in float32, dynamic-range int8 (int8 weights, activations quantized
  at run time) and full int8.

A precision's peak in a runtime is its best rate over the shapes: what an export in that runtime and precision
could reach at most, the denominator of the serving figures' "of peak" (`--mode=serving`). The CPU's features
(AMX, AVX512-BF16, VNNI) are printed and kept in the row: they decide which of these have hardware behind them.
"""

import os
import tempfile

import numpy as np

from experiments.benchmark.results import cpu_flags, cpu_line
from experiments.benchmark.timing import timed
from keras_vit.variants import parse_variant

RUNTIMES = ("tensorflow", "tensorflow XLA", "litert")
# LiteRT's int8 forms: dynamic-range (int8 weights, float32 activations quantized per call) and full integer.
LITERT_PRECISIONS = ("float32", "dynamic int8", "int8")


def block_matmuls(variant, image_size, batch_size):
    """{name: (rows, depth, columns)} of the weight matmuls of one block of `variant`."""
    config = parse_variant(variant)
    (ph, pw), hidden, mlp = config.patch_size, config.hidden_dim, config.mlp_dim
    rows = batch_size * ((image_size // ph) * (image_size // pw) + 1)
    return {
        "qkv": (rows, hidden, 3 * hidden),
        "attention output": (rows, hidden, hidden),
        "mlp in": (rows, hidden, mlp),
        "mlp out": (rows, mlp, hidden),
    }


def _operands(shape, seed=0):
    rows, depth, columns = shape
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (rows, depth)).astype(np.float32), rng.normal(0, 0.05, (depth, columns)).astype(np.float32)


def tensorflow_matmuls(shape, jit):
    """{precision: (function, argument)} of one matmul of `shape` in TensorFlow (XLA with `jit`); int8 without
    XLA only where TensorFlow runs oneDNN (its u8 x s8 kernel has no other)."""
    import tensorflow as tf

    from keras_vit import compat

    x, w = _operands(shape)
    functions = {}
    for precision in ("float32", "bfloat16"):
        weights = tf.constant(w, precision)
        functions[precision] = (
            tf.function(lambda a, weights=weights: tf.matmul(a, weights), jit_compile=jit, autograph=False),
            tf.constant(x, precision),
        )
    scale = 127 / np.abs(w).max()
    int8_weights = np.round(w * scale).astype(np.int8)
    if jit:
        weights = tf.constant(int8_weights)
        functions["int8"] = (
            tf.function(lambda a: tf.matmul(a, weights, output_type=tf.int32), jit_compile=True, autograph=False),
            tf.constant(np.clip(np.round(x * 32), -127, 127).astype(np.int8)),
        )
    elif compat.onednn_enabled():
        weights = tf.bitcast(tf.constant(int8_weights), tf.qint8)
        bias = tf.zeros([shape[2]], tf.float32)
        activations = tf.bitcast(tf.constant(np.clip(np.round((x + 4) * 32), 0, 255).astype(np.uint8)), tf.quint8)

        def int8(a):
            return tf.raw_ops.QuantizedMatMulWithBiasAndDequantize(
                a=a, b=weights, bias=bias, min_a=0.0, max_a=8.0, min_b=-1.0, max_b=1.0, min_freezed_output=-1.0,
                max_freezed_output=1.0, Toutput=tf.float32, input_quant_mode="SCALED",
            )  # fmt: skip

        functions["int8"] = (tf.function(int8, autograph=False), activations)
    return functions


def litert_matmuls(shape, threads, folder):
    """{precision: (function, argument)} of one FULLY_CONNECTED op of `shape` in LiteRT with `threads` threads
    (XNNPACK, LiteRT's default CPU delegate)."""
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    x, w = _operands(shape)
    weights = tf.constant(w)
    spec = tf.TensorSpec(x.shape, tf.float32)
    function = tf.function(lambda a: tf.matmul(a, weights), input_signature=[spec], autograph=False)
    functions = {}
    for precision in LITERT_PRECISIONS:
        converter = tf.lite.TFLiteConverter.from_concrete_functions([function.get_concrete_function()], function)
        if precision != "float32":
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if precision == "int8":
            converter.representative_dataset = lambda: ([x * f] for f in (0.5, 1.0))
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        path = os.path.join(folder, f"{'x'.join(map(str, shape))}_{precision.replace(' ', '_')}.tflite")
        with open(path, "wb") as f:
            f.write(converter.convert())
        interpreter = Interpreter(model_path=path, num_threads=threads)
        interpreter.allocate_tensors()
        index, output = interpreter.get_input_details()[0]["index"], interpreter.get_output_details()[0]["index"]

        def run(a, interpreter=interpreter, index=index, output=output):
            interpreter.set_tensor(index, a)
            interpreter.invoke()
            return interpreter.get_tensor(output)

        functions[precision] = (run, x)
    return functions


def use_threads(threads=None):
    """Sets TensorFlow's intra-op threads to `threads` (None: one per core) and returns them; TensorFlow takes
    them only before its first op, so a process already running another number exits saying so."""
    import tensorflow as tf

    threads = threads or os.cpu_count()
    current = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
    if current != threads:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
        except RuntimeError as error:
            raise SystemExit(
                f"--threads={threads}: TensorFlow already runs {current} threads per op in this process, and takes "
                "another number only before its first op."
            ) from error
    return threads


def best_rate(function, argument, flops, repeats):
    """FLOP/s of `function`'s fastest call of 3 x `repeats`, after three warm-up calls: a peak is what the
    machine reaches at best (a median would let a busy moment lower it below what a model then achieves)."""
    for _ in range(3):
        timed(function, argument)
    return flops / min(timed(function, argument) for _ in range(3 * repeats))


def measure_peaks(variant, image_size, batch_size, repeats, threads=None):
    """{runtime: {precision: {shape name: FLOP/s}}} of the block's matmuls (`block_matmuls`)."""
    threads = threads or os.cpu_count()
    rates = {runtime: {} for runtime in RUNTIMES}
    with tempfile.TemporaryDirectory() as folder:
        for name, shape in block_matmuls(variant, image_size, batch_size).items():
            flops = 2 * shape[0] * shape[1] * shape[2]
            runs = {
                "tensorflow": tensorflow_matmuls(shape, jit=False),
                "tensorflow XLA": tensorflow_matmuls(shape, jit=True),
                "litert": litert_matmuls(shape, threads, folder),
            }
            for runtime, functions in runs.items():
                for precision, (function, argument) in functions.items():
                    rates[runtime].setdefault(precision, {})[name] = best_rate(function, argument, flops, repeats)
    return rates


def peaks_of(rates):
    """{runtime: {precision: FLOP/s}}: each precision's best rate over the shapes."""
    return {runtime: {p: max(shapes.values()) for p, shapes in by.items()} for runtime, by in rates.items()}


def peaks(variant, image_size, batch_size, repeats, threads=None):
    """Prints and returns {"figures": {"flops_per_second": rates, "peaks": ..., "cpu_flags": ...}, "ratios"}:
    each precision's peak against float32's in the same runtime."""
    threads = use_threads(threads)
    rates = measure_peaks(variant, image_size, batch_size, repeats, threads)
    best = peaks_of(rates)
    flags = cpu_flags()
    shapes = block_matmuls(variant, image_size, batch_size)
    print(
        f"Matmul peaks at {variant}'s block shapes, {image_size} px, batch {batch_size}, {threads} threads, "
        f"on {cpu_line(flags)}; GFLOP/s, the fastest of {3 * repeats} calls:"
    )
    print(f"  {'runtime':15s} {'precision':13s} " + " ".join(f"{name:>16s}" for name in shapes) + f" {'peak':>8s}")
    ratios = {}
    for runtime, by_precision in rates.items():
        for precision, by_shape in by_precision.items():
            cells = " ".join(f"{by_shape[name] / 1e9:16.0f}" for name in shapes)
            ratio = best[runtime][precision] / best[runtime]["float32"]
            print(f"  {runtime:15s} {precision:13s} {cells} {best[runtime][precision] / 1e9:8.0f} {ratio:5.2f}x")
            if precision != "float32":
                ratios[f"{runtime} {precision} / float32"] = {"ratio": ratio, "against": f"{runtime} float32"}
    return {
        "figures": {"flops_per_second": rates, "peaks": best, "cpu_flags": flags, "threads": threads},
        "ratios": ratios,
    }
