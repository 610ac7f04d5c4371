"""The paper's claims in miniature: experiments.scaling, experiments.transfer and the ResNet baseline."""

import functools
import json
import math

import keras
import numpy as np
import pytest

from experiments import baselines, datasets, models, scaling, short_runs, transfer
from keras_vit import data as vit_data
from keras_vit.checkpoints import read_npz
from tests.builders import write_folder
from tests.conftest import run_module

# === Where two curves cross ===


def test_crossings_interpolate_in_log_size():
    sizes = [10, 100, 1000]
    # first - second: -0.1 then +0.1: the lead changes half way between 10 and 100 in log size.
    (size, first_ahead), = scaling.crossings(sizes, [0.5, 0.8, 0.9], [0.6, 0.7, 0.8])
    assert size == pytest.approx(10**1.5, rel=1e-12) and first_ahead
    # -0.1, +0.3, -0.1: a quarter of the way from 10 to 100, then three quarters of the way from 100 to 1000.
    found = scaling.crossings(sizes, [0.5, 0.9, 0.7], [0.6, 0.6, 0.8])
    assert [s for s, _ in found] == pytest.approx([10**1.25, 10**2.75], rel=1e-12)
    assert [ahead for _, ahead in found] == [True, False]
    # Curves that swap at uneven spacing: 70 -> 718, difference 0.2 -> -0.05.
    (size, first_ahead), = scaling.crossings([70, 718], [0.9, 0.9], [0.7, 0.95])
    assert size == pytest.approx(math.exp(math.log(70) + 0.8 * math.log(718 / 70)), rel=1e-12) and not first_ahead


def test_no_crossing_and_ties():
    sizes = [10, 100, 1000]
    assert scaling.crossings(sizes, [0.9, 0.95, 0.97], [0.5, 0.7, 0.96]) == []
    # A tie between two different leaders is a crossing at the tie; between the same leader, none.
    assert scaling.crossings(sizes, [0.5, 0.7, 0.9], [0.6, 0.7, 0.8]) == [(100.0, True)]
    assert scaling.crossings(sizes, [0.7, 0.7, 0.9], [0.6, 0.7, 0.8]) == []
    sentence = scaling.describe_crossings(sizes, {"ViT": [0.5, 0.7, 0.95], "ResNet": [0.9, 0.95, 0.97]})
    assert "do not cross between 10 and 1000" in sentence and "ResNet is ahead of ViT" in sentence
    assert "by 2.0 to 40.0 points" in sentence
    sentence = scaling.describe_crossings(sizes, {"ViT": [0.5, 0.9, 0.99], "ResNet": [0.6, 0.8, 0.98]})
    assert sentence == "ViT overtakes ResNet at about 32 training examples."
    with pytest.raises(ValueError, match="positive and increasing"):
        scaling.crossings([10, 10, 100], [0, 0, 0], [1, 1, 1])
    with pytest.raises(ValueError, match="one value of each curve per size"):
        scaling.crossings([10, 100], [0.1, 0.2, 0.3], [0.1, 0.2])


# === Subsets ===


def test_stratified_subsets_are_nested_and_balanced():
    labels = np.repeat(np.arange(3), [10, 20, 40])
    small = datasets.stratified_subset(labels, 7, fraction=0.1)
    large = datasets.stratified_subset(labels, 7, fraction=0.5)
    assert np.bincount(labels[small]).tolist() == [1, 2, 4]
    assert np.bincount(labels[large]).tolist() == [5, 10, 20]
    assert set(small) <= set(large) and np.all(np.diff(large) > 0)
    assert not np.array_equal(large, datasets.stratified_subset(labels, 8, fraction=0.5))  # Another seed, another draw.
    shots = datasets.stratified_subset(labels, 7, per_class=3)
    assert np.bincount(labels[shots]).tolist() == [3, 3, 3]
    assert set(datasets.stratified_subset(labels, 7, per_class=2)) <= set(shots)
    assert len(datasets.stratified_subset(labels, 0, fraction=0.01)) == 3  # At least one per class.
    with pytest.raises(ValueError, match="Class 0 has 10 examples; 11 were asked for"):
        datasets.stratified_subset(labels, 0, per_class=11)
    with pytest.raises(ValueError, match="Give one of"):
        datasets.stratified_subset(labels, 0, fraction=0.5, per_class=2)


def test_an_image_folder_is_read_into_memory_as_evaluation_images(tmp_path):
    """folder: data sets are decoded whole, each image resized and centre-cropped as the training job evaluates it."""
    from experiments.configs import scaling as scaling_config

    root = write_folder(tmp_path / "images", per_class=4, size=(20, 12))
    config = scaling_config.get_config()
    config.dataset, config.image_size, config.test_fraction = f"folder:{root}", 8, 0.25
    dataset = datasets.load_in_memory(config)
    # The scaling config holds out 10% of the 9 training images for validation: one, drawn at random.
    assert (len(dataset.train), len(dataset.validation), len(dataset.test), dataset.num_classes) == (8, 1, 3, 3)
    assert dataset.class_names == ["cat", "dog", "eel"]
    assert dataset.train.images.shape == (8, 8, 8, 3) and dataset.train.images.dtype == np.uint8
    assert np.bincount(np.concatenate([dataset.train.labels, dataset.validation.labels])).tolist() == [3, 3, 3]
    assert dataset.test.labels.dtype == np.int32
    expected = {
        (label, vit_data.center_crop_resize(vit_data.decode_image(path.read_bytes()), (8, 8)).numpy().tobytes())
        for label, name in enumerate(dataset.class_names)
        for path in (root / name).iterdir()
    }
    loaded = {
        (int(label), image.tobytes())
        for split in (dataset.train, dataset.validation, dataset.test)
        for image, label in zip(split.images, split.labels)
    }
    assert loaded == expected


def test_whole_executions_divide_the_epoch():
    assert models.whole_executions(50, 95) == 19  # The CIFAR-10 recipe: 95 steps of 512 per epoch.
    assert models.whole_executions(100, 1251) == 9
    assert models.whole_executions(1, 20) == 1 and models.whole_executions(7, 20) == 5
    assert models.whole_executions(64, 20) == 20


def test_split_classes_relabels_in_the_order_given():
    split = vit_data.Split(np.arange(6, dtype=np.uint8).reshape(6, 1, 1, 1), np.array([0, 5, 7, 5, 2, 7], np.int32))
    dataset = vit_data.Dataset(split, split, 8, [str(i) for i in range(8)])
    train, test = transfer.split_classes(dataset, [7, 5])
    assert train.labels.tolist() == [1, 0, 1, 0] and train.images[:, 0, 0, 0].tolist() == [1, 2, 3, 5]
    assert test.labels.tolist() == train.labels.tolist()


# === The ResNet baseline ===


def test_resnet_parameter_count_and_save_reload(tmp_path):
    model = baselines.build_resnet((16, 12), 10, widths=(8, 16))

    def conv_bn(kernel, inputs, outputs):  # Convolution without bias, then gamma, beta, moving mean and variance.
        return kernel * kernel * inputs * outputs + 4 * outputs

    expected = (
        conv_bn(3, 3, 8)  # stem
        + 2 * conv_bn(3, 8, 8)  # stage 0: identity shortcut
        + conv_bn(3, 8, 16) + conv_bn(3, 16, 16) + conv_bn(1, 8, 16)  # stage 1: stride 2, projection
        + 16 * 10 + 10  # head
    )
    assert model.count_params() == expected == 5_410
    assert len(model.trainable_weights) == 6 + 6 * 2 + 2  # 6 kernels, 6 batch norms (gamma, beta), the head
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 12, 3)).astype(np.uint8)
    logits = model.predict(images, verbose=0)
    assert logits.shape == (2, 10) and logits.dtype == np.float32
    model.save(tmp_path / "resnet.keras")
    reloaded = keras.saving.load_model(tmp_path / "resnet.keras")
    np.testing.assert_array_equal(reloaded.predict(images, verbose=0), logits)
    with pytest.raises(ValueError, match=r"Received: widths=\(8, 0\)"):
        baselines.build_resnet(16, 10, widths=(8, 0))


# === The experiments, end to end from the command line ===

# Tiny models and two steps per run: what is checked is the plumbing and the outputs, not accuracy.
TINY = {
    "model__hidden_dim": 16, "model__num_layers": 1, "model__num_heads": 2, "model__mlp_dim": 32, "jit_compile": "off"
}


def run_tiny(module, workdir, **overrides):
    """Runs `python -m module` with the tiny model and `--config.KEY=VALUE` for each override (`__` for a dot)."""
    fields = {**TINY, **overrides}
    flags = [f"--config.{key.replace('__', '.')}={value}" for key, value in fields.items()]
    return run_module(module, f"--workdir={workdir}", *flags)


def tiny_config(config_module, **overrides):
    """The config of `config_module` with the tiny model and each override (`__` for a dot), as `run_tiny`'s
    command line sets them."""
    config = config_module.get_config()
    config.update_from_flattened_dict({key.replace("__", "."): value for key, value in {**TINY, **overrides}.items()})
    return config


def check_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000


def check_point(point, seeds):
    accuracies = np.array(point["test_accuracy"])
    assert len(accuracies) == len(point["train_accuracy"]) == len(point["seconds"]) == len(seeds)
    assert np.all((accuracies >= 0) & (accuracies <= 1)) and np.all(np.array(point["train_accuracy"]) <= 1)
    assert point["mean"] == pytest.approx(accuracies.mean()) and point["std"] == pytest.approx(accuracies.std(ddof=1))


@pytest.mark.slow
def test_scaling_writes_its_json_table_and_figure(tmp_path):
    stdout = run_tiny(
        "experiments.scaling", tmp_path, fractions=(0.05, 0.2), seeds=(3, 4), steps=4, batch_size=16,
        cnn__widths=(4, 8), eval_every=1, patience=2,
    )
    results = json.loads((tmp_path / "scaling.json").read_text())
    # The subsets come from the training images less the validation split (10%, stratified) that stops each run.
    digits = vit_data.load_digits(image_size=16, validation_fraction=0.1)
    counts = np.bincount(digits.train.labels)
    sizes = [int(sum(max(1, round(f * n)) for n in counts)) for f in (0.05, 0.2)]
    assert results["sizes"] == sizes and results["dataset_validation"] == len(digits.validation) == 144
    assert results["seeds"] == [3, 4] and results["fractions"] == [0.05, 0.2]
    assert results["dataset"] == {"name": "digits", "num_train": 1293, "num_test": 360, "num_classes": 10}
    assert results["budget"] == {"steps": 4, "batch_size": 16, "eval_every": 1, "patience": 2}
    assert results["config"]["cnn"]["widths"] == [4, 8]
    assert list(results["models"]) == ["ViT", "ResNet"]
    for model in results["models"].values():
        assert [p["size"] for p in model["points"]] == results["sizes"]
        for point in model["points"]:
            check_point(point, [3, 4])
            # Stopped after 2 evaluations without improvement, or at the 4 steps; the best step's weights kept.
            for steps, best in zip(point["steps"], point["best_step"]):
                assert 1 <= best <= steps <= 4 and (steps == 4 or steps == best + 2)
            assert all(0 <= a <= 1 for a in point["validation_accuracy"])
    assert results["models"]["ResNet"]["parameters"] == baselines.build_resnet(16, 10, widths=(4, 8)).count_params()
    means = [[p["mean"] for p in m["points"]] for m in results["models"].values()]
    assert results["crossings"] == [
        {"size": s, "vit_ahead_after": ahead} for s, ahead in scaling.crossings(results["sizes"], *means)
    ]
    assert results["summary"] in stdout
    table = (tmp_path / "scaling.md").read_text()
    assert table.count("\n") == 4 and f"| {sizes[1]} | " in table and "ViT steps" in table
    check_png(tmp_path / "scaling.png")


@pytest.mark.parametrize("ema_momentum", [0.0, 0.9])
def test_early_stopping_keeps_the_best_weights_and_needs_whole_evaluation_periods(ema_momentum):
    from experiments.configs import scaling as scaling_config

    # With a moving average of the weights, the average is measured and kept.
    config = tiny_config(scaling_config, batch_size=16, ema_momentum=ema_momentum)
    dataset = datasets.load_in_memory(config)
    train = datasets.take(dataset.train, np.arange(64))
    make_model = functools.partial(models.build_model, config, dataset.num_classes)
    (model, result), = short_runs.train_runs(
        make_model, [(0, train)], dataset.test, config=config, steps=6, warmup_steps=1, batch_size=16,
        num_classes=10, validation=dataset.validation, eval_every=2, patience=1,
    )
    assert result["steps"] in (2, 4, 6) and result["best_step"] in (2, 4, 6)
    # The weights kept are the best evaluation's: the validation accuracy measured then is the model's now.
    assert short_runs.accuracy(model, dataset.validation, 16) == result["validation_accuracy"]
    with pytest.raises(ValueError, match="must divide `steps`. Received: eval_every=4, steps=6"):
        next(short_runs.train_runs(
            make_model, [(0, train)], dataset.test, config=config, steps=6, warmup_steps=1, batch_size=16,
            num_classes=10, validation=dataset.validation, eval_every=4, patience=1,
        ))


@pytest.mark.slow
def test_transfer_writes_its_checkpoint_json_table_and_figure(tmp_path, capsys):
    """In this process, through the job's `run`; its command line is `jobs.run_job`'s, which the scaling
    test runs end to end."""
    from experiments.configs import transfer as transfer_config

    config = tiny_config(
        transfer_config, source_classes=(0, 1, 2, 3, 4), pretrain_steps=2, warmup_steps=1, batch_size=16,
        target__shots=(2, 4), target__seeds=(0, 1), target__steps=2, target__batch_size=8,
    )
    transfer.run(config, str(tmp_path))
    stdout = capsys.readouterr().out
    results = json.loads((tmp_path / "transfer.json").read_text())
    digits = vit_data.load_digits(image_size=16)
    source, target = results["source"], results["target"]
    assert source["classes"] == [0, 1, 2, 3, 4] and target["classes"] == [5, 6, 7, 8, 9]
    assert source["num_test"] == int(np.sum(digits.test.labels < 5))
    assert target["num_test"] == int(np.sum(digits.test.labels >= 5))
    assert 0 <= source["test_accuracy"] <= 1
    assert target["shots"] == [2, 4] and target["seeds"] == [0, 1]
    assert list(results["methods"]) == ["scratch", "frozen_backbone", "fine_tune"]
    for method in results["methods"].values():
        assert [(p["shots"], p["size"]) for p in method["points"]] == [(2, 10), (4, 20)]
        for point in method["points"]:
            check_point(point, [0, 1])
    # Only the new head trains on the frozen backbone: hidden_dim x 5 classes + 5 biases.
    assert results["methods"]["frozen_backbone"]["trainable_parameters"] == 16 * 5 + 5
    everything = results["methods"]["scratch"]["trainable_parameters"]
    assert results["methods"]["fine_tune"]["trainable_parameters"] == everything > 1000
    # The pre-trained model was written as an original checkpoint, the file a user downloads.
    params = read_npz(tmp_path / "pretrained.npz")
    assert params["head/kernel"].shape == (16, 5) and "Transformer/encoderblock_0/LayerNorm_0/scale" in params
    assert "fine_tune (" in stdout and (tmp_path / "transfer.md").read_text().count("\n") == 5
    check_png(tmp_path / "transfer.png")
