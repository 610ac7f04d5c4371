"""Timing and the matmul peak, shared by the benchmark's modes.

- `timed`, `time_calls`: seconds of a call until its result is computed, and
  the interleaved median of several functions.
- `matmul_peak_functions`, `matmul_peak_rates`, `median_peaks`: one square
  matmul at a precision, with and without XLA where the backend has both, and
  its FLOP/s; the "of peak" of every mode is against them.
- `machine_name`: what the figures were measured on, as the reports print it.
"""

import platform
import statistics
import time

import keras
import numpy as np

# A pause before each timed call, so that no thread pool of the previous one
# (TensorFlow's, XLA's, PyTorch's OpenMP threads in the timm worker) still
# spins on the cores.
SETTLE_SECONDS = 0.5


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


def machine_name():
    """The accelerator the backend computes on, else the CPU's model name."""
    if keras.backend.backend() == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform != "cpu":
            return f"{jax.device_count()} x {device.device_kind} ({device.platform})"
    return cpu_name()


def cpu_name():
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
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
        import tensorflow as tf

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


def median_peaks(rates):
    """{name: FLOP/s}: the median of each entry of `matmul_peak_rates` (or of several, concatenated)."""
    return {name: statistics.median(values) for name, values in rates.items()}
