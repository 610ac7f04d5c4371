"""A training config checked field by field before the job writes anything (`check_config`).

A bad value (a negative learning rate, a precision Keras does not know, an unknown variant) would otherwise
fail, or worse train, after the work directory was made and a previous run's files were replaced. Each error
names the field as the command line sets it (`--config.FIELD=VALUE`), what it received and what it expects.
"""

import numbers

import keras

from keras_vit import training
from keras_vit.layers.core import MLP_ACTIVATIONS
from keras_vit.model import CLASSIFIERS, POSITION_EMBEDDINGS
from keras_vit.variants import ViTConfig, parse_variant, to_pair


class ConfigError(ValueError):
    """A config field with a value the job cannot run with."""


def _fail(field, value, expected):
    raise ConfigError(f"config.{field} must be {expected}. Received: --config.{field}={value!r}")


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(field, value, minimum):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        _fail(field, value, f"an integer >= {minimum}")


def _real(field, value, low, high=None, *, low_open=False, high_open=False):
    """`value` a number in [low, high] (either end open when told)."""
    ok = _number(value) and (value > low if low_open else value >= low)
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        _fail(field, value, f"a number in {left}{low}, {'inf' if high is None else high}{right}")


def _one_of(field, value, choices):
    if value not in choices:
        _fail(field, value, f"one of {tuple(choices)}")


def _check_model(config):
    model = dict(config.model)
    variant = model.pop("variant")
    fields = set(ViTConfig.__dataclass_fields__)
    try:
        vit = parse_variant(variant, **{k: v for k, v in model.items() if k in fields})
    except (TypeError, ValueError) as error:
        overrides = {k: v for k, v in model.items() if k in fields}
        raise ConfigError(
            f"config.model.variant with {overrides or 'no overrides'}: {error} "
            f"Received: --config.model.variant={variant!r}"
        ) from None
    _one_of("model.classifier", model.get("classifier", "token"), CLASSIFIERS)
    _one_of("model.position_embedding", model.get("position_embedding", "learned"), POSITION_EMBEDDINGS)
    _one_of("model.activation", model.get("activation", "gelu"), MLP_ACTIVATIONS)
    for rate in ("dropout_rate", "attention_dropout_rate", "stochastic_depth_rate"):
        if rate in model:
            _real(f"model.{rate}", model[rate], 0.0, 1.0, high_open=True)
    if model.get("representation_size") is not None:
        _integer("model.representation_size", model["representation_size"], 1)
    if vit.resnet_layers is None:  # A hybrid's stride is checked when it is built.
        height, width = to_pair(config.image_size, "image_size")
        if height % vit.patch_size[0] or width % vit.patch_size[1]:
            _fail("image_size", config.image_size, f"divisible by the patch size {vit.patch_size} of {variant!r}")


def _check_augment(augment):
    ranges = augment.crop_area_range
    if not (
        isinstance(ranges, (tuple, list)) and len(ranges) == 2 and all(_number(x) for x in ranges)
        and 0 < ranges[0] <= ranges[1] <= 1
    ):
        _fail("augment.crop_area_range", ranges, "(low, high) with 0 < low <= high <= 1")
    randaugment = augment.randaugment
    if randaugment is not None:
        if not (isinstance(randaugment, (tuple, list)) and len(randaugment) == 2):
            _fail("augment.randaugment", randaugment, "None or (num_ops, magnitude)")
        _integer("augment.randaugment[0] (num_ops)", randaugment[0], 0)
        _real("augment.randaugment[1] (magnitude)", randaugment[1], 0.0)
    for alpha in ("mixup_alpha", "cutmix_alpha"):
        _real(f"augment.{alpha}", augment[alpha], 0.0)
    _real("augment.switch_prob", augment.switch_prob, 0.0, 1.0)


DATASET_NAMES = "'digits', 'tfds:NAME[:SPLIT]' or 'folder:PATH'"


def check_dataset_name(what, name):
    """Raises `ConfigError` unless `name` is a data set name the jobs read (`what` names the setting)."""
    kind, _, rest = str(name).partition(":")
    if name != "digits" and not (kind in ("tfds", "folder") and rest):
        raise ConfigError(f"{what} must be {DATASET_NAMES}. Received: {name!r}")


def check_config(config):
    """Raises `ConfigError` naming the first field of `config` (a training config, see
    `experiments/configs/common.py`) whose value the job cannot run with; returns `config`.

    Cheap: nothing is built, read or written.
    """
    check_dataset_name("config.dataset", config.dataset)
    _integer("epochs", config.epochs, 1)
    _integer("batch_size", config.batch_size, 1)
    _real("learning_rate", config.learning_rate, 0.0, low_open=True)
    _real("weight_decay", config.weight_decay, 0.0)
    _integer("warmup_epochs", config.warmup_epochs, 0)
    _integer("warmup_steps", config.warmup_steps, 0)
    _real("grad_clip_norm", config.grad_clip_norm, 0.0)
    _real("label_smoothing", config.label_smoothing, 0.0, 1.0, high_open=True)
    _real("ema_momentum", config.ema_momentum, 0.0, 1.0, high_open=True)
    _real("layer_decay", config.layer_decay, 0.0, 1.0, low_open=True)
    _integer("grad_accum_steps", config.grad_accum_steps, 1)
    if config.batch_size % config.grad_accum_steps:
        _fail("grad_accum_steps", config.grad_accum_steps, f"a divisor of config.batch_size={config.batch_size}")
    _one_of("optimizer", config.optimizer, training.OPTIMIZERS)
    _one_of("decay", config.decay, training.DECAYS)
    _one_of("jit_compile", config.jit_compile, training.JIT_COMPILE)
    _one_of("verbose", config.verbose, (0, 1, 2))
    _integer("steps_per_execution", config.steps_per_execution, 1)
    if config.backup_every != "epoch":
        # From the command line a number arrives as a string: the field's default, "epoch", is one.
        every = config.backup_every
        _integer("backup_every", int(every) if isinstance(every, str) and every.isdigit() else every, 1)
    _real("backup_minutes", config.backup_minutes, 0)
    _real("grace_seconds", config.grace_seconds, 0, low_open=True)
    try:
        keras.dtype_policies.get(config.precision)
    except (TypeError, ValueError):
        _fail("precision", config.precision, "a Keras dtype policy, e.g. 'float32', 'mixed_bfloat16', 'mixed_float16'")
    if config.num_classes:
        _integer("num_classes", config.num_classes, 2)
    _integer("image_size", config.image_size, 1)
    _real("test_fraction", config.test_fraction, 0.0, 1.0, low_open=True, high_open=True)
    _real("validation_fraction", config.validation_fraction, 0.0, 1.0, high_open=True)
    _real("crop_fraction", config.crop_fraction, 0.0, 1.0, low_open=True)
    _integer("image_limits.max_pixels", config.image_limits.max_pixels, 1)
    _real("image_limits.max_aspect_ratio", config.image_limits.max_aspect_ratio, 1.0)
    _integer("shuffle_buffer", config.shuffle_buffer, 1)
    _integer("max_shift", config.max_shift, 0)
    _integer("visualize_images", config.visualize_images, 1)
    _integer("tensorboard_figures", config.tensorboard_figures, 0)
    _integer("tensorboard_figure_epochs", config.tensorboard_figure_epochs, 0)
    _check_augment(config.augment)
    _check_model(config)
    return config
