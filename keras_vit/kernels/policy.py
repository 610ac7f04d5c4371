"""Which form of a kernel runs: decided each time a kernel is traced.

`current()` describes where the ops being traced will run: the Keras backend,
the kind of device ("cpu", "gpu" or "tpu") and whether the caller asked for
portable ops. It is computed on every call, from

- TensorFlow: the devices of the distribution strategy in force (inside
  `strategy.scope()` or a replica's step), otherwise the logical devices
  TensorFlow places ops on by default (a GPU or TPU wins over the CPU);
- JAX: the devices of the `keras.distribution` in force, otherwise JAX's
  default backend;
- PyTorch: whether CUDA is available;

and never remembered: a model traced on a CPU and traced again once a GPU or
TPU is connected, or under a strategy over accelerators, gets the second
trace's forms.

Three explicit switches, for the ops traced within them on the calling thread:
`portable_ops()` (the reference forms, which every runtime and converter
knows; exports trace inside it), `cpu_serving()` (TensorFlow's forms for a CPU
with oneDNN, wherever the tracing runs: the SavedModels of a CPU precision) and
`fused_attention(enabled)` (force `keras.ops.dot_product_attention` on or off,
to compare the two).

`device()` is also what `keras_vit.training.resolve_jit_compile("auto")` reads to
decide whether a step is XLA-compiled, and `default_device` says where a backend
places ops outside any strategy or distribution (what Keras itself reads on JAX,
for the guard in `kernels.fused`).
"""

import contextlib
import contextvars
import dataclasses

import keras

from keras_vit import compat

DEVICES = ("cpu", "gpu", "tpu")

# The two switches' values for the code running within them: context-local (each thread, and each
# asyncio task, sees its own), set on entering a switch and restored on leaving it. The module's
# only state; nothing is remembered between traces.
_PORTABLE = contextvars.ContextVar("keras_vit_portable_ops", default=False)
_FUSED_ATTENTION = contextvars.ContextVar("keras_vit_fused_attention", default=None)
_CPU_SERVING = contextvars.ContextVar("keras_vit_cpu_serving", default=False)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the ops being traced will run."""

    backend: str
    device: str
    portable: bool = False
    fused_attention: bool | None = None  # None: the rule in `use_fused_attention`.
    cpu_serving: bool = False

    @property
    def onednn(self):
        """Whether the ops will run on TensorFlow's oneDNN CPU kernels: in this process
        (`keras_vit.compat.onednn_enabled()`), or inside `cpu_serving()`, where a CPU that has them serves."""
        return self.cpu_serving or (self.backend == "tensorflow" and compat.onednn_enabled())

    @property
    def tensorflow_cpu(self):
        """TensorFlow ops on a CPU, outside `portable_ops()`: where the `tf_cpu` forms apply."""
        return self.backend == "tensorflow" and self.device == "cpu" and not self.portable

    @property
    def use_fused_attention(self):
        """Whether attention may be `keras.ops.dot_product_attention`.

        On a GPU or TPU with a backend other than TensorFlow, where it
        dispatches to a fused kernel (cuDNN's on NVIDIA GPUs) or to the
        backend's own formulation (on TPUs `kernels.fused` keeps it off Keras'
        Splash route). TensorFlow's version is the same batched matmuls as the
        reference form.
        """
        if self.fused_attention is not None:
            return self.fused_attention
        return self.backend != "tensorflow" and self.device != "cpu" and not self.portable


def current():
    """The `Target` of the ops traced now."""
    backend = keras.backend.backend()
    serving = _CPU_SERVING.get() and backend == "tensorflow"
    return Target(
        backend=backend,
        device="cpu" if serving else device(backend),
        portable=_PORTABLE.get() and not serving,
        fused_attention=_FUSED_ATTENTION.get(),
        cpu_serving=serving,
    )


def device(backend=None):
    """The kind of device ("cpu", "gpu" or "tpu") where ops traced now with `backend` (default: Keras') run: the
    devices of the distribution strategy (TensorFlow) or `keras.distribution` (JAX) in force,
    otherwise `default_device(backend)`."""
    backend = backend or keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
            if isinstance(strategy, tf.distribute.TPUStrategy):
                return "tpu"
            return device_kind(strategy.extended.worker_devices)
    if backend == "jax":
        distribution = keras.distribution.distribution()
        if distribution is not None:
            return device_kind(distribution.device_mesh.devices.flatten())
    return default_device(backend)


def default_device(backend=None):
    """The kind of device ("cpu", "gpu" or "tpu") where `backend` (default: Keras') places ops outside any
    distribution strategy or `keras.distribution`.

    TensorFlow: the logical devices it places ops on by default (a GPU or TPU
    wins over the CPU). JAX: its default backend, the platform of
    `jax.devices()[0]`. PyTorch: a GPU where CUDA is available.
    """
    backend = backend or keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        for kind in ("TPU", "GPU"):
            if tf.config.list_logical_devices(kind):
                return kind.lower()
        return "cpu"
    if backend == "jax":
        import jax

        return device_kind([jax.default_backend()])
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return "cpu"


def device_kind(devices):
    """The strongest kind ("tpu", then "gpu", else "cpu") among `devices`, given as TensorFlow names
    ("/job:worker/device:GPU:0"), Keras' ("gpu:0"), JAX platforms ("cuda") or JAX devices
    (their `platform`)."""
    kinds = set()
    for name in devices:
        name = getattr(name, "platform", None) or str(name).rsplit("device:", 1)[-1]
        kinds.add(name.strip("/").lower())
    for kind, prefixes in (("tpu", ("tpu",)), ("gpu", ("gpu", "cuda", "rocm"))):
        if any(name.startswith(prefixes) for name in kinds):
            return kind
    return "cpu"


@contextlib.contextmanager
def _switch(variable, value):
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def portable_ops():
    """Kernels traced within it use their reference forms: ops that every runtime
    and converter knows (TFLite, ONNX, any device). Exports trace inside it."""
    return _switch(_PORTABLE, True)


def cpu_serving():
    """Kernels traced within it (TensorFlow) take their forms for inference on a CPU with oneDNN, wherever the
    tracing runs and whether or not this process runs oneDNN: a SavedModel for TF Serving on CPUs in bfloat16 or
    int8 (`keras_vit.export_saved_model(precision=...)`). Inside `portable_ops()` too."""
    return _switch(_CPU_SERVING, True)


def fused_attention(enabled):
    """Attention traced within it is `keras.ops.dot_product_attention` (True) or
    the reference form's explicit matmuls and softmax (False), on any backend
    and device. Both compute the same function; for comparing them."""
    return _switch(_FUSED_ATTENTION, bool(enabled))
