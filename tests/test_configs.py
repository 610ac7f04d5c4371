"""The shipped experiment configs: they parse, build their model, and fail early without their data."""

import importlib
import re

import keras
import pytest

from experiments import models, train

CONFIGS = {
    # module: (variant, image size, parameters of the model the config builds)
    "digits": ("Ti/2", 16, 139_722),
    "cifar10_b16": ("B/16", 384, 86_567_656 - 769_000 + 7_690 + (577 - 197) * 768),
    # Fixed sin-cos position embeddings (no weights) and a pre-logits layer of 384 (rep_size=True).
    "imagenet_s16": ("S/16", 224, 22_049_896 - 196 * 384 + 384 * 384 + 384),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_builds_its_model(name):
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    variant, image_size, params = CONFIGS[name]
    assert config.model.variant == variant and config.image_size == image_size
    num_classes = config.get("num_classes") or 10
    model = models.build_model(config, num_classes)
    assert model.count_params() == params
    keras.backend.clear_session()


@pytest.mark.parametrize("name", ["cifar10_b16", "imagenet_s16"])
def test_config_without_prepared_data_fails_before_training(name, tmp_path):
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    config.data_dir = str(tmp_path / "tensorflow_datasets")
    with pytest.raises(ValueError, match="not prepared in data_dir"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert keras.mixed_precision.global_policy().name == "float32"  # nothing was set up


def test_unknown_dataset_and_class_mismatch(tmp_path):
    from experiments.configs import digits

    config = digits.get_config()
    config.dataset = "imagenet"
    with pytest.raises(ValueError, match=r"config.dataset must be 'digits', .*Received: 'imagenet'"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    config = digits.get_config()
    config.num_classes = 100
    with pytest.raises(ValueError, match="num_classes=100 but the data set 'digits' has 10 classes"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_imagenet_s16_is_big_vision_vit_s16_i1k():
    """The points of big_vision's configs/vit_s16_i1k.py that are config fields here (the docstring names
    the differences)."""
    from experiments.configs import imagenet_s16

    config = imagenet_s16.get_config()
    assert (config.dataset, config.validation_split, config.test_split) == (
        "tfds:imagenet2012:train[:99%]", "train[99%:]", "validation"
    )
    assert config.cache and config.shuffle_buffer == 250_000
    assert (config.batch_size, config.epochs, config.learning_rate, config.warmup_steps) == (1024, 90, 1e-3, 10_000)
    assert config.weight_decay * config.learning_rate == pytest.approx(1e-4) and config.weight_decay_kernels_only
    assert config.grad_clip_norm == 1.0 and config.decay == "cosine" and config.label_smoothing == 0.0
    assert tuple(config.augment.crop_area_range) == (0.05, 1.0) and tuple(config.augment.randaugment) == (2, 10)
    assert config.augment.mixup_alpha == 0.2 and config.augment.cutmix_alpha == 0.0
    assert dict(config.model) == {
        "variant": "S/16", "classifier": "gap", "position_embedding": "sincos2d", "representation_size": 384,
        "dropout_rate": 0.0, "attention_dropout_rate": 0.0, "stochastic_depth_rate": 0.0, "activation": "gelu",
    }
    assert {name: (e.dataset, e.split, e.label) for name, e in config.extra_evals.items()} == {
        "v2": ("imagenet_v2", "test", "label"), "real": ("imagenet2012_real", "validation", "real_label"),
    }


@pytest.mark.parametrize("shape", [(375, 500), (500, 333), (256, 256), (480, 640), (221, 300)])
def test_imagenet_s16_evaluation_crop_is_big_vision_resize_small_256_central_crop_224(shape):
    """crop_fraction 0.875 at 224 against big_vision's `resize_small(256)|central_crop(224)` (TensorFlow's
    "area" resize, sizes rounded, cast to uint8), on smooth photo-like images: the same region, resampled
    a little differently (bilinear with antialiasing): within 1.25 grey levels on average, 8 at most."""
    import numpy as np
    import tensorflow as tf

    from experiments.configs import imagenet_s16
    from keras_vit import data as vit_data

    config = imagenet_s16.get_config()
    height, width = shape
    coarse = np.random.default_rng(height * width).uniform(0, 255, (1, 6, 8, 3)).astype(np.float32)
    image = tf.cast(tf.clip_by_value(tf.round(tf.image.resize(coarse, shape, method="bicubic")[0]), 0, 255), tf.uint8)
    ours = vit_data.center_crop_resize(image, (config.image_size,) * 2, config.crop_fraction).numpy()
    ratio = 256 / min(shape)
    resized = tf.image.resize(tf.cast(image, tf.float32), (round(height * ratio), round(width * ratio)), "area")
    top, left = (resized.shape[0] - 224) // 2, (resized.shape[1] - 224) // 2
    theirs = tf.cast(tf.clip_by_value(resized[top:top + 224, left:left + 224], 0, 255), tf.uint8).numpy()
    difference = np.abs(ours.astype(int) - theirs.astype(int))
    assert ours.shape == (224, 224, 3) and difference.mean() < 1.25 and difference.max() <= 8, difference.mean()


BAD_FIELDS = [
    ("learning_rate", -1.0), ("learning_rate", 0), ("epochs", -1), ("epochs", 0), ("batch_size", 0),
    ("precision", "float8"), ("optimizer", "adam"), ("decay", "step"), ("label_smoothing", 1.0),
    ("validation_fraction", 1.0), ("test_fraction", 0.0), ("backup_every", -5), ("warmup_steps", -1),
    ("model.variant", "Q/16"), ("model.classifier", "cls"), ("model.dropout_rate", 1.5), ("image_size", 30),
    ("augment.crop_area_range", (0.5, 0.1)), ("augment.randaugment", (2, -1)), ("augment.switch_prob", 2),
    ("image_limits.max_pixels", 0), ("image_limits.max_aspect_ratio", 0.5),
]


@pytest.mark.parametrize("field, value", BAD_FIELDS, ids=[f"{f}={v}" for f, v in BAD_FIELDS])
def test_a_bad_config_field_is_named_before_anything_runs(field, value):
    from experiments import config_checks

    config = importlib.import_module("experiments.configs.imagenet_s16").get_config()  # patch 16: 30 px fails
    *parents, last = field.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    with node.ignore_type():
        node[last] = value
    shown = field.split("[")[0]
    with pytest.raises(config_checks.ConfigError, match=rf"config\.{re.escape(shown)}.*Received"):
        config_checks.check_config(config)


def test_the_configs_image_limits_are_the_library_defaults():
    import dataclasses

    from keras_vit.data import ImageLimits

    config = importlib.import_module("experiments.configs.common").get_base_config()
    assert config.image_limits.to_dict() == dataclasses.asdict(ImageLimits())


@pytest.mark.parametrize("name", [*CONFIGS, "scaling", "transfer"])
def test_the_shipped_configs_pass_the_checks(name):
    from experiments import config_checks

    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    assert config_checks.check_config(config) is config


@pytest.mark.parametrize(
    "field, value, pattern",
    [("learning_rate", -1.0, r"config\.learning_rate must be a number in \(0.0, inf\]. Received: --config"),
     ("epochs", -1, r"config\.epochs must be an integer >= 1. Received: --config.epochs=-1"),
     ("precision", "float8", r"config\.precision must be a Keras dtype policy")],
)
def test_the_job_refuses_a_bad_field_before_making_or_touching_the_workdir(tmp_path, field, value, pattern):
    from experiments import config_checks
    from experiments.configs import digits

    config = digits.get_config()
    with config.ignore_type():
        config[field] = value
    with pytest.raises(config_checks.ConfigError, match=pattern):
        train.train_and_evaluate(config, str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    # An existing run's files are left as they were.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.json").write_text('{"test_accuracy": 0.98}')
    with pytest.raises(config_checks.ConfigError, match=pattern):
        train.train_and_evaluate(config, str(tmp_path / "old"))
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["metrics.json"]
    assert (tmp_path / "old" / "metrics.json").read_text() == '{"test_accuracy": 0.98}'
