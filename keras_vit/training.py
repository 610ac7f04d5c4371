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

from keras_vit import compat
from keras_vit.compat import ClipAfterAllReduce, LearningRateScales
from keras_vit.kernels import policy

OPTIMIZERS = ("adamw", "sgd")
DECAYS = ("cosine", "linear")


@keras.saving.register_keras_serializable(package="keras_vit")
class AdamW(ClipAfterAllReduce, LearningRateScales, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` that clips the all-reduced gradient (see the module doc) and takes
    `learning_rate_scales` (`layer_decay_scales`)."""


@keras.saving.register_keras_serializable(package="keras_vit")
class SGD(ClipAfterAllReduce, LearningRateScales, keras.optimizers.SGD):
    """`keras.optimizers.SGD` that clips the all-reduced gradient (see the module doc) and takes
    `learning_rate_scales` (`layer_decay_scales`)."""


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


def keeps_moving_average(optimizer):
    """Whether `optimizer` (or the one a `LossScaleOptimizer` wraps) keeps a moving average of the weights
    (`use_ema=True`)."""
    return bool(getattr(getattr(optimizer, "inner_optimizer", optimizer), "use_ema", False))


def layer_decay_scales(model, decay):
    """Layer-wise learning-rate decay (BEiT, Bao et al. 2021; timm's `--layer-decay`): `{variable.path: factor}`
    for `model`'s trainable variables, for `learning_rate_scales`.

    With L transformer blocks, the head (and everything after the last block:
    the final norm, the pooling, the representation layer) trains at the base
    rate, block i (0 .. L-1) at `decay ** (L - i)`, and the embeddings
    (everything before the first block: the patch and position embeddings,
    the class token, a hybrid's ResNet, `pre_norm`) at `decay ** (L + 1)`.
    `model` is a ViT of `keras_vit.build_vit` (its layers in order, the blocks
    `TransformerBlock`s).
    """
    from keras_vit.layers import TransformerBlock

    if not 0 < decay <= 1:
        raise ValueError(f"`decay` must be in (0, 1]. Received: decay={decay!r}")
    layers = list(model.layers)
    blocks = [layer for layer in layers if isinstance(layer, TransformerBlock)]
    if not blocks:
        raise ValueError(
            f"Layer-wise decay needs a model whose layers include its TransformerBlocks (a build_vit model); "
            f"{model.name!r} has none among {[layer.name for layer in layers][:10]}."
        )
    depth, first = len(blocks), layers.index(blocks[0])
    scales = {}
    for position, layer in enumerate(layers):
        if isinstance(layer, TransformerBlock):
            level = blocks.index(layer) + 1
        else:
            level = 0 if position < first else depth + 1
        for variable in layer.trainable_weights:
            scales[variable.path] = float(decay ** (depth + 1 - level))
    return scales


def make_optimizer(
    name,
    learning_rate,
    total_steps,
    warmup_steps,
    *,
    weight_decay=0.0,
    decay="cosine",
    grad_clip_norm=1.0,
    ema_momentum=0.0,
    layer_decay=1.0,
    model=None,
):
    """A paper recipe's optimizer: "adamw" (pre-training) or "sgd" (fine-tuning, momentum 0.9).

    `weight_decay` is decoupled (AdamW); SGD fine-tuning uses none, as in the paper.
    `ema_momentum` > 0 keeps a moving average of the weights (Keras' `use_ema`:
    `average = m * average + (1 - m) * weights` after every update; see
    `EMAWeights`), as timm's `--model-ema` does.  `layer_decay` < 1 scales each
    layer's rate (and weight decay) of `model` by `layer_decay_scales`.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {OPTIMIZERS}. Received: optimizer={name!r}")
    if not 0 <= ema_momentum < 1:
        raise ValueError(f"`ema_momentum` must be in [0, 1) (0: no moving average). Received: {ema_momentum!r}")
    options = {"global_clipnorm": grad_clip_norm}
    if ema_momentum:
        options.update(use_ema=True, ema_momentum=ema_momentum)
    if layer_decay != 1:
        if model is None:
            raise ValueError("Layer-wise decay (layer_decay < 1) needs the model, to find its layers.")
        options["learning_rate_scales"] = layer_decay_scales(model, layer_decay)
    schedule = learning_rate_schedule(learning_rate, total_steps, warmup_steps, decay)
    if name == "adamw":
        return AdamW(schedule, weight_decay=weight_decay, **options)
    if weight_decay:
        raise ValueError(
            f"SGD fine-tuning uses no weight decay (paper, appendix B.1.1). Received: weight_decay={weight_decay}"
        )
    return SGD(schedule, momentum=0.9, **options)


# === XLA or not ===

JIT_COMPILE = ("auto", "on", "off")


def resolve_jit_compile(jit_compile="auto", precision=None, training=True, strategy=None):
    """The `jit_compile` for `model.compile`: "on"/True, "off"/False, or "auto".

    "auto" picks what works, and of that what runs fastest, for the
    distribution strategy, platform and precision (`_use_xla` has the rule and
    why). In short: no XLA under a TensorFlow strategy over several replicas
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
    return _use_xla(precision, training=training, strategy=strategy)


def _use_xla(precision=None, training=True, strategy=None):
    """`resolve_jit_compile("auto")`: whether a step compiled now should be XLA-compiled: what works, and of
    that what runs fastest, for the distribution strategy, platform (`keras_vit.kernels.policy.device()`) and
    precision (measure it with `python -m experiments.benchmark`).

    - TensorFlow under a strategy over several replicas or a TPU
      (`MirroredStrategy`, `MultiWorkerMirroredStrategy`, `TPUStrategy`, ...):
      no XLA, Keras' own rule for `tf.distribute`. A TPU compiles each step
      with XLA whatever `jit_compile` says; `MirroredStrategy` over several
      devices of one host cannot run an XLA-compiled step whose variables
      live on several devices ("Trying to access resource ... located in
      device CPU:1 from device CPU:0"), and XLA has no CPU collectives for
      `MultiWorkerMirroredStrategy` ("Collectives are not yet implemented for
      CPU devices when compiling with XLA").
    - Otherwise (no strategy or TensorFlow's default one, `OneDeviceStrategy`, Keras' JAX backend with
      or without `keras.distribution`):
      - GPU, TPU and the JAX backend: XLA, always.
      - CPU, TensorFlow with oneDNN (`keras_vit.compat.onednn_enabled()`):
        - float32: XLA for training, whose backward pass has much
          element-wise work for XLA to fuse; no XLA for inference, where
          TensorFlow's graph optimiser fuses the forward pass into oneDNN
          kernels that run it faster than XLA's CPU code.
        - bfloat16 or float16: no XLA. oneDNN runs bfloat16 matmuls on the
          CPU's bfloat16 units (AMX, AVX512-BF16) while XLA's CPU compiler
          computes them at float32 speed.
      - CPU, TensorFlow without oneDNN (TensorFlow leaves it off on CPUs
        without AVX512-VNNI, AVX512-BF16 or AMX): XLA, always; TensorFlow's
        own CPU kernels then neither fuse the forward pass nor have fast
        16-bit matmuls.

    Like the kernels' forms, it is decided from where the call is made, each time.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        return True
    if backend == "tensorflow" and not _one_device(strategy):
        return False
    if policy.device(backend) != "cpu":
        return True
    if not compat.onednn_enabled():
        return True
    precision = precision or keras.mixed_precision.global_policy().name
    return training and keras.mixed_precision.Policy(precision).compute_dtype == "float32"


def _one_device(strategy=None):
    """Whether `strategy` (default: TensorFlow's strategy in force) is none at all, TensorFlow's default one
    or a `OneDeviceStrategy`, where XLA compiles the step as without a strategy."""
    import tensorflow as tf

    from keras_vit.distribute import on_one_device

    return on_one_device(strategy or tf.distribute.get_strategy())
