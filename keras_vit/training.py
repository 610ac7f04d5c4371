"""Training recipes: the paper's optimizers and schedules, ready for `model.compile`.

- Pre-training (paper Table 3; "Better plain ViT baselines"): AdamW with
  decoupled weight decay, linear warm-up, then cosine (or linear) decay,
  gradient clipping at global norm 1.0.
- Fine-tuning (paper section 4.1 / appendix B.1.1): SGD with momentum 0.9, no
  weight decay, short warm-up, cosine decay, clipping at global norm 1.0.

Gradient clipping under a multi-replica strategy: Keras clips each replica's
gradients before summing them across replicas, so the clipped update depends
on the number of replicas.  The optimizers built here (`AdamW`, `SGD`) clip
the all-reduced gradient instead, which is what a single device does with the
same global batch; `keras_vit.compat.ClipAfterAllReduce` holds the part that
reaches into the optimizer's private methods.

TensorFlow is imported where it is used, so that the JAX and PyTorch backends
can build, train and benchmark models without it installed.
"""

import keras

from keras_vit.compat import ClipAfterAllReduce
from keras_vit.files import atomic_path, write_text_atomically
from keras_vit.kernels import policy

OPTIMIZERS = ("adamw", "sgd")
DECAYS = ("cosine", "linear")


@keras.saving.register_keras_serializable(package="keras_vit")
class AdamW(ClipAfterAllReduce, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` that clips the all-reduced gradient (see the module doc)."""


@keras.saving.register_keras_serializable(package="keras_vit")
class SGD(ClipAfterAllReduce, keras.optimizers.SGD):
    """`keras.optimizers.SGD` that clips the all-reduced gradient (see the module doc)."""


def learning_rate_schedule(base_rate, total_steps, warmup_steps, decay="cosine"):
    """Linear warm-up from 0 to `base_rate`, then cosine or linear decay to 0."""
    if decay not in DECAYS:
        raise ValueError(f"`decay` must be one of {DECAYS}. Received: decay={decay!r}")
    if total_steps < 1 or not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"Expected 0 <= warmup_steps < total_steps. Received: warmup_steps={warmup_steps}, "
            f"total_steps={total_steps}"
        )
    decay_steps = total_steps - warmup_steps
    if decay == "cosine":
        return keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps, warmup_target=base_rate, warmup_steps=warmup_steps
        )
    return WarmupLinearDecay(base_rate, total_steps, warmup_steps)


@keras.saving.register_keras_serializable(package="keras_vit")
class WarmupLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to `base_rate` over `warmup_steps`, then linear decay to 0 at `total_steps`."""

    def __init__(self, base_rate, total_steps, warmup_steps):
        self.base_rate = float(base_rate)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warmup = step / max(self.warmup_steps, 1)
        decay = (self.total_steps - step) / max(self.total_steps - self.warmup_steps, 1)
        factor = keras.ops.where(step < self.warmup_steps, warmup, decay)
        return self.base_rate * keras.ops.clip(factor, 0.0, 1.0)

    def get_config(self):
        return {"base_rate": self.base_rate, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps}


def make_optimizer(
    name,
    learning_rate,
    total_steps,
    warmup_steps,
    *,
    weight_decay=0.0,
    decay="cosine",
    grad_clip_norm=1.0,
):
    """A paper recipe's optimizer: "adamw" (pre-training) or "sgd" (fine-tuning, momentum 0.9).

    `weight_decay` is decoupled (AdamW); SGD fine-tuning uses none, as in the paper.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {OPTIMIZERS}. Received: optimizer={name!r}")
    schedule = learning_rate_schedule(learning_rate, total_steps, warmup_steps, decay)
    if name == "adamw":
        return AdamW(schedule, weight_decay=weight_decay, global_clipnorm=grad_clip_norm)
    if weight_decay:
        raise ValueError(
            f"SGD fine-tuning uses no weight decay (paper, appendix B.1.1). Received: weight_decay={weight_decay}"
        )
    return SGD(schedule, momentum=0.9, global_clipnorm=grad_clip_norm)


class CSVLog(keras.callbacks.Callback):
    """Per-epoch metrics as CSV, on any file system tf.io.gfile reaches (gs:// included).

    Keras's CSVLogger fails on remote paths (keras 3.15: it asks the GFile for
    `closed`) and object stores cannot append, so the whole file is rewritten
    after each epoch, whole or not at all (`keras_vit.files.atomic_path`).
    Rows already in the file (a resumed run) are kept.
    """

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.header, self.rows = None, []

    def on_train_begin(self, logs=None):
        import tensorflow as tf

        if tf.io.gfile.exists(self.path):
            with tf.io.gfile.GFile(self.path, "r") as f:
                lines = f.read().splitlines()
            if lines:
                self.header, self.rows = lines[0].split(","), lines[1:]

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        if self.header is None:
            self.header = ["epoch"] + sorted(logs)
        values = {"epoch": epoch, **logs}
        self.rows.append(",".join(str(float(values[k]) if k != "epoch" else epoch) for k in self.header))
        write_text_atomically(self.path, "\n".join([",".join(self.header), *self.rows]) + "\n")


class AtomicModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras' `ModelCheckpoint` (same arguments, monitor and `save_best_only`
    included) that writes each checkpoint whole or not at all.

    Keras writes `filepath` in place: a save that fails (a full disk) would
    leave a damaged file where the best model was.  Here each save goes to a
    temporary beside `filepath` (`keras_vit.files.atomic_path`), renamed onto
    it once complete.  Saves once per epoch (`save_freq="epoch"`), to one
    path (no `{epoch}` placeholders).
    """

    def __init__(self, filepath, **kwargs):
        if kwargs.get("save_freq", "epoch") != "epoch":
            raise ValueError(f"AtomicModelCheckpoint saves once per epoch. Received: save_freq={kwargs['save_freq']!r}")
        filepath = str(filepath)
        if "{" in filepath:
            raise ValueError(f"AtomicModelCheckpoint writes one path, without placeholders. Received: {filepath!r}")
        super().__init__(filepath, **kwargs)
        self.destination = filepath

    def on_epoch_end(self, epoch, logs=None):
        # Keras reads the format from the name's end (".keras", ".h5", ".weights.h5"): the temporary keeps it.
        suffix = ".weights.h5" if self.destination.endswith(".weights.h5") else "." + self.destination.split(".")[-1]
        try:
            with atomic_path(self.destination, suffix=suffix) as temporary:
                # What `ModelCheckpoint` saves, if anything, goes to the temporary.
                self.filepath = temporary
                super().on_epoch_end(epoch, logs)
        finally:
            self.filepath = self.destination


# === XLA or not ===

JIT_COMPILE = ("auto", "on", "off")


def accelerator():
    """"tpu", "gpu" or "cpu": where the current Keras backend computes (inside a
    distribution strategy's scope, where its devices are); `keras_vit.kernels.policy.device()`."""
    return policy.device()


def resolve_jit_compile(jit_compile="auto", precision=None, training=True, strategy=None):
    """The `jit_compile` for `model.compile`: "on"/True, "off"/False, or "auto".

    "auto" picks what works, and of that what runs fastest, for the
    distribution strategy, platform and precision: the platform policy's rule,
    `keras_vit.kernels.policy.use_xla`, beside the one that picks the kernels'
    forms. In short: no XLA under a TensorFlow strategy over several replicas
    or a TPU (Keras' own rule); XLA on a GPU, a TPU and the JAX backend; on a
    CPU with TensorFlow and oneDNN, XLA for float32 training only; on a CPU
    without oneDNN, XLA always.

    Args:
        jit_compile: "auto", "on", "off", or a bool.
        precision: the dtype policy name ("float32", "mixed_bfloat16", ...);
            the global policy when None.
        training: whether the model is compiled to train (`fit`) or only to
            predict.
        strategy: the `tf.distribute.Strategy` the model is compiled under;
            by default the one whose scope is entered (TensorFlow backend).
    """
    if isinstance(jit_compile, bool):
        return jit_compile
    if jit_compile not in JIT_COMPILE:
        raise ValueError(
            f"`jit_compile` must be one of {JIT_COMPILE} or a bool. Received: jit_compile={jit_compile!r}"
        )
    if jit_compile != "auto":
        return jit_compile == "on"
    return policy.use_xla(precision, training=training, strategy=strategy)
