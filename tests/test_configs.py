"""The shipped experiment configs: they parse, build their model, and fail early without their data."""

import importlib

import keras
import pytest

from experiments import common, train

CONFIGS = {
    # module: (variant, image size, parameters of the model the config builds)
    "digits": ("Ti/2", 16, 139_722),
    "cifar10_b16": ("B/16", 384, 86_567_656 - 769_000 + 7_690 + (577 - 197) * 768),
    "imagenet_s16": ("S/16", 224, 22_049_896 - 196 * 384),  # Fixed sin-cos position embeddings: no weights.
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_builds_its_model(name):
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    variant, image_size, params = CONFIGS[name]
    assert config.model.variant == variant and config.image_size == image_size
    num_classes = config.get("num_classes") or 10
    model = common.build_model(config, num_classes)
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
    with pytest.raises(ValueError, match="Unknown image data set 'imagenet'"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    config = digits.get_config()
    config.num_classes = 100
    with pytest.raises(ValueError, match="num_classes=100 but the data set 'digits' has 10 classes"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
