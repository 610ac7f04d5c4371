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

Two explicit switches, for the ops traced within them on the calling thread:
`portable_ops()` (the reference forms, which every runtime and converter
knows; exports trace inside it) and `fused_attention(enabled)` (force
`keras.ops.dot_product_attention` on or off, to compare the two).
"""

import contextlib
import dataclasses
import threading

import keras

DEVICES = ("cpu", "gpu", "tpu")

_SWITCHES = threading.local()


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the ops being traced will run."""

    backend: str
    device: str
    portable: bool = False
    fused_attention: bool | None = None  # None: the rule in `use_fused_attention`.

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
    return Target(
        backend=backend,
        device=device(backend),
        portable=bool(getattr(_SWITCHES, "portable", False)),
        fused_attention=getattr(_SWITCHES, "fused_attention", None),
    )


def device(backend=None):
    """"cpu", "gpu" or "tpu": where ops traced now with `backend` (default: Keras') run."""
    backend = backend or keras.backend.backend()
    if backend == "tensorflow":
        return _tensorflow_device()
    if backend == "jax":
        return _jax_device()
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return "cpu"


def _kind(devices):
    """The strongest kind among devices: TensorFlow names ("/job:worker/device:GPU:0"),
    Keras' ("gpu:0") or JAX devices (their `platform`)."""
    kinds = set()
    for device in devices:
        name = getattr(device, "platform", None) or str(device).rsplit("device:", 1)[-1]
        kinds.add(name.strip("/").lower())
    for kind, prefixes in (("tpu", ("tpu",)), ("gpu", ("gpu", "cuda", "rocm"))):
        if any(name.startswith(prefixes) for name in kinds):
            return kind
    return "cpu"


def _tensorflow_device():
    import tensorflow as tf

    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        if isinstance(strategy, tf.distribute.TPUStrategy):
            return "tpu"
        return _kind(strategy.extended.worker_devices)
    for kind in ("TPU", "GPU"):
        if tf.config.list_logical_devices(kind):
            return kind.lower()
    return "cpu"


def _jax_device():
    distribution = keras.distribution.distribution()
    if distribution is not None:
        return _kind(distribution.device_mesh.devices.flatten())
    import jax

    return _kind([jax.default_backend()])


@contextlib.contextmanager
def _switch(name, value):
    previous = getattr(_SWITCHES, name, None)
    setattr(_SWITCHES, name, value)
    try:
        yield
    finally:
        setattr(_SWITCHES, name, previous)


def portable_ops():
    """Kernels traced within it use their reference forms: ops that every runtime
    and converter knows (TFLite, ONNX, any device). Exports trace inside it."""
    return _switch("portable", True)


def fused_attention(enabled):
    """Attention traced within it is `keras.ops.dot_product_attention` (True) or
    the reference form's explicit matmuls and softmax (False), on any backend
    and device. Both compute the same function; for comparing them."""
    return _switch("fused_attention", bool(enabled))
