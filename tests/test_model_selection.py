"""Model selection that never looks at the test split: a validation split held out of the training data for
every source, the training job validating and choosing best.keras on it, the test split read only after
training, and the extra test sets (ImageNet-v2, ReaL) evaluated when present."""

import json
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from experiments import datasets, extra_test_sets, models, train
from experiments.configs import digits as digits_config
from keras_vit import callbacks
from keras_vit import data as vit_data
from tests.builders import prepare_tfds, tiny_digits_config, write_folder


def fingerprints(split):
    """The (label, image bytes) of every example of an in-memory split, as a sorted list (a multiset)."""
    return sorted((int(y), x.tobytes()) for x, y in zip(split.images, split.labels))


def names(source, split):
    """The file names (folders) or TFDS ids a split of `source` lists, in its order, nothing decoded."""
    records, total = source.read(split, None, False, 0, 0)
    found = [name.decode() for _, _, name in records.as_numpy_iterator()]
    assert len(found) == total
    return found


# === The digits ===


def test_digits_validation_is_a_stratified_share_of_the_training_images():
    whole = vit_data.load_digits(image_size=16, test_fraction=0.2, seed=0)
    held = vit_data.load_digits(image_size=16, test_fraction=0.2, seed=0, validation_fraction=0.1)
    assert whole.validation is None
    assert (len(held.train), len(held.validation), len(held.test)) == (1293, 144, 360)
    # The test split does not move; train and validation together are the former training split.
    assert fingerprints(held.test) == fingerprints(whole.test)
    together = vit_data.Split(
        np.concatenate([held.train.images, held.validation.images]),
        np.concatenate([held.train.labels, held.validation.labels]),
    )
    assert fingerprints(together) == fingerprints(whole.train)
    # Stratified: 14 or 15 of each class (10% of 143-146).
    assert set(np.bincount(held.validation.labels, minlength=10)) <= {14, 15}
    # Seeded: the same seed, the same images; another seed, others.
    again = vit_data.load_digits(image_size=16, seed=0, validation_fraction=0.1)
    other = vit_data.load_digits(image_size=16, seed=1, validation_fraction=0.1)
    assert fingerprints(again.validation) == fingerprints(held.validation)
    assert fingerprints(other.validation) != fingerprints(held.validation)
    # The former positional construction still works.
    assert vit_data.Dataset(held.train, held.test, 10, list("0123456789")).validation is None
    with pytest.raises(ValueError, match=r"`validation_fraction` must be in \[0, 1\). Received: validation_fraction=1"):
        vit_data.load_digits(validation_fraction=1)


# === Folders ===


def test_folder_validation_is_held_out_of_the_training_files(tmp_path):
    root = write_folder(tmp_path / "images", per_class=10, size=(12, 10))
    whole = vit_data.load_folder(root, test_fraction=0.2, seed=0)
    source = vit_data.load_folder(root, test_fraction=0.2, seed=0, validation_fraction=0.25)
    assert (whole.num_train, whole.num_validation, whole.num_test) == (24, 0, 6)
    assert (source.num_train, source.num_validation, source.num_test) == (18, 6, 6)
    train, validation, test = (names(source, split) for split in ("train", "validation", "test"))
    assert test == names(whole, "test")  # the test split does not move
    assert sorted(train + validation) == names(whole, "train")
    assert not set(train) & set(validation)
    # Stratified: two files of each class.
    assert sorted(name.split("/")[-2] for name in validation) == ["cat", "cat", "dog", "dog", "eel", "eel"]
    assert source.splits == {
        "train": f"the rest of the files in {root}",
        "validation": "25% of the other files, stratified by class (seed 0)",
        "test": f"20% of the files in {root}, stratified by class (seed 0)",
    }
    decoded = list(source.validation.as_numpy_iterator())
    assert len(decoded) == 6 and all(x.shape == (12, 10, 3) for x, _ in decoded)
    with pytest.raises(ValueError, match=r"`split` must be 'train' or 'test'. Received: split='validation'. No val"):
        whole.decoded("validation")
    with pytest.raises(ValueError, match="must be 'train', 'validation' or 'test'. Received: split='minival'"):
        source.decoded("minival")


def test_folder_with_train_and_test_subfolders_holds_out_validation_from_train_or_reads_validation(tmp_path):
    write_folder(tmp_path / "ds" / "train", per_class=8)
    write_folder(tmp_path / "ds" / "test", per_class=2)
    source = vit_data.load_folder(tmp_path / "ds", validation_fraction=0.25, seed=3)
    assert (source.num_train, source.num_validation, source.num_test) == (18, 6, 6)
    validation = names(source, "validation")
    assert all("/ds/train/" in name for name in validation + names(source, "train"))
    assert sorted(name.split("/")[-2] for name in validation) == ["cat", "cat", "dog", "dog", "eel", "eel"]
    assert source.splits["validation"] == f"25% of {tmp_path / 'ds'}/train, stratified by class (seed 3)"

    write_folder(tmp_path / "ds" / "validation", per_class=1)  # used as it is, whatever the fraction
    source = vit_data.load_folder(tmp_path / "ds", validation_fraction=0.25)
    assert (source.num_train, source.num_validation, source.num_test) == (24, 3, 6)
    assert all("/ds/validation/" in name for name in names(source, "validation"))
    assert source.splits == {name: f"{tmp_path / 'ds'}/{name}" for name in ("train", "validation", "test")}


# === TFDS ===


def tfds_set(tmp_path, count=20, num_shards=None, corrupt=()):
    """A prepared TFDS set of `count` training and 4 test images (files written by `write_folder`)."""
    root = write_folder(tmp_path / "files", per_class=(count + 2) // 3, corrupt=corrupt)
    files = sorted(p for p in root.rglob("*.*"))
    classes = {"cat": 0, "dog": 1, "eel": 2}
    train = [(classes[p.parent.name], p) for p in files][:count]
    test = [(classes[p.parent.name], p) for p in files[-4:]]
    return prepare_tfds(tmp_path, {"train": train, "test": test}, num_shards)


def test_tfds_validation_is_a_slice_of_the_training_split(tmp_path):
    data_dir = tfds_set(tmp_path, 20)
    whole = vit_data.load_tfds("tiny_colours", data_dir=data_dir)
    source = vit_data.load_tfds("tiny_colours", data_dir=data_dir, validation_fraction=0.1)
    assert source.splits == {"train": "train[:90%]", "validation": "train[90%:]", "test": "test"}
    assert (source.num_train, source.num_validation, source.num_test) == (18, 2, 4)
    train, validation = names(source, "train"), names(source, "validation")
    assert not set(train) & set(validation) and sorted(train + validation) == sorted(names(whole, "train"))
    # Not a whole percent: cut at an example.
    source = vit_data.load_tfds("tiny_colours", data_dir=data_dir, validation_fraction=0.125)
    assert source.splits["train"] == "train[:18]" and source.splits["validation"] == "train[18:]"
    # Named explicitly, as big_vision's ImageNet minival; through the job's names too.
    source = vit_data.load_image_source(
        "tfds:tiny_colours:train[:75%]", data_dir=data_dir, validation_split="train[75%:]"
    )
    assert (source.num_train, source.num_validation) == (15, 5)
    assert len(list(source.validation.as_numpy_iterator())) == 5
    with pytest.raises(ValueError, match=r"the train split 'train' and the validation split 'train\[75%:\]' share 5"):
        vit_data.load_tfds("tiny_colours", data_dir=data_dir, validation_split="train[75%:]")
    with pytest.raises(ValueError, match=r"'train\[:50%\]' is sliced already; give the validation split itself"):
        vit_data.load_tfds("tiny_colours", data_dir=data_dir, train_split="train[:50%]", validation_fraction=0.1)


@pytest.mark.parametrize("num_shards, pipelines", [(4, 2), (1, 3)])
def test_tfds_sliced_splits_shard_over_input_pipelines(tmp_path, num_shards, pipelines):
    """Sliced splits read by several input pipelines (by file with 4 shards, by even ranges with 1): disjoint
    shares that together are the slice; a corrupt record in it is skipped and named by its TFDS id."""
    data_dir = tfds_set(tmp_path, 20, num_shards, corrupt=["cat/0.jpg"])
    source = vit_data.load_tfds("tiny_colours", data_dir=data_dir, validation_fraction=0.2)
    for split, count in (("train", 16), ("validation", 4)):
        shares = []
        for index in range(pipelines):
            context = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=index)
            records, total = source.read(split, context, True, 0, 100)
            shares.append([name.decode() for _, _, name in records.as_numpy_iterator()])
            assert len(shares[-1]) == total
        assert sum(map(len, shares)) == count and len(set().union(*shares)) == count
        assert sorted(sum(shares, [])) == sorted(names(source, split))
    decoded = sum(1 for _ in source.train) + sum(1 for _ in source.validation)
    assert decoded == 19 and source.skipped.count == 1 and "tfrecord" in source.skipped.paths[0]


# === Extra test sets: ImageNet-v2 and ReaL, as small TFDS sets made here ===


def prepare_evaluation_sets(tmp_path, images, labels):
    """Two prepared TFDS sets of `images`: "tiny_v2" (split "test", a ClassLabel) and "tiny_real" (split
    "validation", "real_label" a Sequence of ClassLabel: the label, also the next class for every third
    image, none for every fifth). Returns (data_dir, the real labels as lists)."""
    import tensorflow_datasets as tfds

    real = [[] if i % 5 == 4 else [int(y)] + ([(int(y) + 1) % 10] if i % 3 == 0 else []) for i, y in enumerate(labels)]

    class TinyV2(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"image": tfds.features.Image(shape=(None, None, 3)), "label": tfds.features.ClassLabel(num_classes=10)}
            ))

        def _split_generators(self, dl_manager):
            return {"test": self._generate_examples()}

        def _generate_examples(self):
            for i, (x, y) in enumerate(zip(images, labels)):
                yield i, {"image": x, "label": int(y)}

    class TinyReal(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(None, None, 3)),
                "original_label": tfds.features.ClassLabel(num_classes=10),
                "real_label": tfds.features.Sequence(tfds.features.ClassLabel(num_classes=10)),
            }))

        def _split_generators(self, dl_manager):
            return {"validation": self._generate_examples()}

        def _generate_examples(self):
            for i, (x, y) in enumerate(zip(images, labels)):
                yield i, {"image": x, "original_label": int(y), "real_label": real[i]}

    data_dir = str(tmp_path / "tfds_eval")
    for builder in (TinyV2, TinyReal):
        builder(data_dir=data_dir).download_and_prepare()
    return data_dir, real


def test_real_accuracy_counts_a_prediction_among_the_real_labels_and_leaves_out_unlabelled_images():
    logits = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    real = np.array([[0, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert extra_test_sets.real_accuracy(logits, real) == pytest.approx(2 / 3)  # 3 labelled images, 2 hits
    with pytest.raises(ValueError, match="No image has a real label"):
        extra_test_sets.real_accuracy(logits, np.zeros_like(real))


def test_evaluation_sets_load_their_labels_and_a_missing_one_is_skipped_and_logged(tmp_path, caplog):
    digits = vit_data.load_digits(image_size=16)
    images, labels = digits.test.images[:12], digits.test.labels[:12]
    data_dir, real = prepare_evaluation_sets(tmp_path, images, labels)
    ds, count, classes = vit_data.load_tfds_evaluation(
        "tiny_real", "validation", data_dir=data_dir, label_key="real_label"
    )
    loaded = list(ds.as_numpy_iterator())
    assert (count, classes, len(loaded)) == (12, 10, 12)
    expected = {x.tobytes(): sorted(r) for x, r in zip(images, real)}
    for image, multi_hot in loaded:
        assert multi_hot.dtype == np.float32 and sorted(np.flatnonzero(multi_hot)) == expected[image.tobytes()]
    ds, count, _ = vit_data.load_tfds_evaluation("tiny_v2", "test", data_dir=data_dir)
    assert sorted(int(y) for _, y in ds.as_numpy_iterator()) == sorted(labels.tolist())

    config = digits_config.get_config()
    config.data_dir = data_dir
    config.extra_evals = {"v3": {"dataset": "tiny_v3", "split": "test", "label": "label"}}
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Flatten(), keras.layers.Dense(10)])
    with caplog.at_level(logging.INFO, logger="absl"):
        results = extra_test_sets.extra_evaluations(config, model)
    assert results == {"v3": {"data": "tfds:tiny_v3:test", "skipped": results["v3"]["skipped"]}}
    assert "not prepared in data_dir" in results["v3"]["skipped"]
    assert "Skipped the extra evaluation 'v3' on tfds:tiny_v3:test" in caplog.text


# === The training job ===


class TrainingOver(keras.callbacks.Callback):
    """Says whether `fit` has returned (set at on_train_end), and which epoch runs."""

    over, epoch = False, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_end(self, logs=None):
        self.over, self.epoch = True, None


def watched(ds, reads, label, over, epochs=None):
    """`ds` that appends (label, training over?) to `reads` for every element read, and the epoch that runs
    to `epochs` if given.  (Under a tf.distribute strategy, Keras reads an evaluation set more than once per
    pass: count epochs, not reads.)"""

    def note():
        reads.append((label, over.over))
        if epochs is not None:
            epochs.append(over.epoch)
        return np.int64(0)

    def mark(*element):
        with tf.control_dependencies([tf.py_function(note, [], tf.int64)]):
            return tuple(tf.identity(t) for t in element)

    return ds.map(mark)


def run_watched(config, workdir, monkeypatch):
    """Runs the training job with every read of its validation and test splits recorded: (metrics, reads:
    (what, training over?) in order, validation_epochs: the epoch running at each validation read, None
    after training)."""
    reads, over, validation_epochs = [], TrainingOver(), []
    load_data = datasets.load_data

    def watched_load_data(config, strategy=None):
        data = load_data(config, strategy)
        make_test = data.make_test

        def watched_make_test():
            reads.append(("make_test", over.over))
            return watched(make_test(), reads, "test", over)

        data.validation = watched(data.validation, reads, "validation", over, validation_epochs)
        data.make_test = watched_make_test
        return data

    monkeypatch.setattr(datasets, "load_data", watched_load_data)
    metrics = train.train_and_evaluate(config, str(workdir), callbacks=[over])
    return metrics, reads, validation_epochs


def check_model_selection(reads, validation_epochs):
    """The test split built and read after training only; the validation split read in every epoch (2),
    then for the final model and best.keras."""
    test_reads = [over_then for what, over_then in reads if what in ("make_test", "test")]
    assert test_reads and all(test_reads), reads
    assert reads.index(("make_test", True)) < min(i for i, (what, _) in enumerate(reads) if what == "test")
    assert sorted(set(validation_epochs), key=str) == [0, 1, None]
    assert validation_epochs == sorted(validation_epochs, key=lambda epoch: 2 if epoch is None else epoch)


@pytest.mark.slow
def test_the_job_reports_the_final_and_the_best_model_on_each_split_and_on_the_extra_test_sets(
    tmp_path, monkeypatch
):
    """Every read of the test split is recorded with whether training was over: the job fails this test if it
    builds the test pipeline, or reads one test image, before `fit` returns.  The validation split is read
    in each epoch (where best.keras is chosen), and then for the final and the best model.  The figures of
    metrics.json, recomputed from model.keras and best.keras; the splits named.  Extra test sets (ImageNet-v2
    and ReaL-like, made here) are evaluated for both models; one that is absent is skipped.  The figures after
    training (config.visualize) read the test split here; the per-epoch TensorBoard figures, which read the
    validation split, are watched by the image folder's test below."""
    digits = vit_data.load_digits(image_size=16)
    images, labels = digits.test.images[:40], digits.test.labels[:40]
    data_dir, real = prepare_evaluation_sets(tmp_path, images, labels)
    config = tiny_digits_config(epochs=2)
    config.tensorboard_figures = 0
    config.data_dir = data_dir
    config.extra_evals = {
        "v2": {"dataset": "tiny_v2", "split": "test", "label": "label"},
        "real": {"dataset": "tiny_real", "split": "validation", "label": "real_label"},
        "absent": {"dataset": "tiny_absent", "split": "test", "label": "label"},
    }
    workdir = tmp_path / "run"
    evaluated_best = []
    report_best = train.report_best
    monkeypatch.setattr(train, "report_best", lambda *args: evaluated_best.append(1) or report_best(*args))
    metrics, reads, validation_epochs = run_watched(config, workdir, monkeypatch)
    check_model_selection(reads, validation_epochs)

    assert (metrics["train_examples"], metrics["validation_examples"], metrics["test_examples"]) == (1293, 144, 360)
    assert metrics["splits"] == {
        "train": {"data": "digits: the rest of the other 1,437", "examples": 1293},
        "validation": {"data": "digits: 10% of the other 1,437, stratified by class (seed 0)", "examples": 144},
        "test": {"data": "digits: 20% of the 1,797 images, stratified by class (seed 0)", "examples": 360},
    }
    assert metrics["steps"] == 2 * (1293 // 64)
    history = json.loads((workdir / "history.json").read_text())
    # The figures of metrics.json, recomputed from the saved models.
    final, best = (keras.saving.load_model(workdir / name) for name in ("model.keras", "best.keras"))
    held = vit_data.load_digits(image_size=16, validation_fraction=0.1)

    def accuracy(model, split):
        return float(np.mean(model.predict(split.images, verbose=0).argmax(-1) == split.labels))

    assert metrics["test_accuracy"] == pytest.approx(accuracy(final, held.test), abs=1e-6)
    assert metrics["validation_accuracy"] == pytest.approx(accuracy(final, held.validation), abs=1e-6)
    assert metrics["validation_accuracy"] == pytest.approx(history["val_accuracy"][-1], abs=1e-6)
    assert metrics["best_validation_accuracy"] == pytest.approx(max(history["val_accuracy"]), abs=1e-6)
    assert metrics["best_validation_accuracy"] == pytest.approx(accuracy(best, held.validation), abs=1e-6)
    assert metrics["best_test_accuracy"] == pytest.approx(accuracy(best, held.test), abs=1e-6)
    # best.keras is evaluated unless the last epoch wrote it (the first epoch with the best accuracy), when it is
    # the final model, whose figures it takes.
    best_is_final = int(np.argmax(history["val_accuracy"])) == len(history["val_accuracy"]) - 1
    assert len(evaluated_best) == (not best_is_final)
    if best_is_final:
        assert metrics["best_test_loss"] == metrics["test_loss"], metrics

    extra = metrics["extra_evals"]
    assert extra["absent"]["data"] == "tfds:tiny_absent:test" and "not prepared" in extra["absent"]["skipped"]
    hot = np.zeros((len(real), 10), np.float32)
    for i, classes in enumerate(real):
        hot[i, classes] = 1
    for name, model in (("accuracy", final), ("best_accuracy", best)):
        logits = model.predict(images, verbose=0)
        assert extra["v2"][name] == pytest.approx(float(np.mean(logits.argmax(-1) == labels)), abs=1e-6)
        assert extra["real"][name] == pytest.approx(extra_test_sets.real_accuracy(logits, hot), abs=1e-6)
    assert extra["v2"]["examples"] == extra["v2"]["examples_evaluated"] == 40
    assert extra["real"]["examples_with_labels"] == 32 and extra["real"]["data"] == "tfds:tiny_real:validation"
    assert json.loads((workdir / "metrics.json").read_text()) == metrics


@pytest.mark.slow
def test_on_an_image_folder_the_source_reads_its_test_split_only_after_training(tmp_path, monkeypatch):
    """A folder source whose `read` records each split it is asked for, and each record read from it.  The
    per-epoch TensorBoard figures (on by default) read the validation split here; the figures after training
    (config.visualize) are watched by the digits' test above."""
    root = write_folder(tmp_path / "images", per_class=8, size=(20, 20))
    reads, over = [], TrainingOver()
    load_image_source = vit_data.load_image_source

    def watched_source(*args, **kwargs):
        source = load_image_source(*args, **kwargs)
        read = source.read

        def watched_read(split, *rest):
            reads.append((f"read {split}", over.over))
            records, total = read(split, *rest)
            return watched(records, reads, split, over), total

        source.read = watched_read
        read_pass = source.read_pass

        def watched_pass(split, *rest):  # The training passes, each in its own order.
            reads.append((f"read {split}", over.over))
            return watched(read_pass(split, *rest), reads, split, over)

        source.read_pass = watched_pass
        return source

    monkeypatch.setattr(vit_data, "load_image_source", watched_source)
    config = tiny_digits_config(epochs=2)
    config.dataset, config.batch_size, config.validation_fraction = f"folder:{root}", 4, 0.25
    config.model.patch_size = 4
    config.visualize = False
    metrics = train.train_and_evaluate(config, str(tmp_path / "run"), callbacks=[over])
    assert (metrics["train_examples"], metrics["validation_examples"], metrics["test_examples"]) == (14, 5, 5)
    assert metrics["splits"]["validation"] == {
        "data": "25% of the other files, stratified by class (seed 0)", "examples": 5
    }
    test = [over_then for what, over_then in reads if what in ("read test", "test")]
    assert test and all(test), reads
    validation = [over_then for what, over_then in reads if what == "validation"]
    assert validation.count(False) >= 2 * 5  # every validation image, each epoch, during training
    assert any(what == "train" and not over_then for what, over_then in reads)


def test_weight_decay_on_the_kernels_only():
    """With config.weight_decay_kernels_only (big_vision's default), a step with zero gradients shrinks the
    kernels by lr * weight_decay and leaves biases, norms and embeddings as they are."""
    import keras_vit
    from keras_vit.testing import randomize_weights

    config = digits_config.get_config()
    config.weight_decay, config.learning_rate, config.weight_decay_kernels_only = 0.1, 1e-2, True
    model = keras_vit.build_vit("testing", image_size=16, num_classes=3, patch_size=4, representation_size=8)
    randomize_weights(model)  # no zero weight, which decay would leave as it is
    optimizer = models.make_optimizer(config, 10, 0, model=model)
    before = [w.numpy() for w in model.trainable_weights]
    rate = float(optimizer.learning_rate)  # at step 0: 1e-2 (no warm-up)
    optimizer.apply_gradients([(keras.ops.zeros_like(w), w) for w in model.trainable_weights])
    decayed = []
    for weight, old in zip(model.trainable_weights, before):
        if not np.array_equal(weight.numpy(), old):
            decayed.append(weight.path)
            np.testing.assert_allclose(weight.numpy(), old * (1 - rate * 0.1), rtol=1e-6, err_msg=weight.path)
    assert rate == pytest.approx(1e-2)
    assert decayed == [w.path for w in model.trainable_weights if w.name.endswith("kernel")]
    assert {path.split("/")[0] for path in decayed} >= {"patch_encoder", "pre_logits", "head"}
    assert len(decayed) < len(model.trainable_weights) // 2  # biases, norms, class token, position embedding


def test_the_config_reaches_the_training_pipeline(tmp_path, monkeypatch):
    """config.shuffle_buffer, data_service, cache and the crop's area range are what training_pipeline is
    given; an empty data_service is None (the pipeline runs here)."""
    root = write_folder(tmp_path / "images", per_class=4, size=(12, 10))
    seen = []

    def training_pipeline(source, image_size, batch_size, input_context=None, **kwargs):
        seen.append(kwargs)
        return tf.data.Dataset.range(1)

    monkeypatch.setattr(vit_data, "training_pipeline", training_pipeline)
    config = digits_config.get_config()
    config.dataset, config.shuffle_buffer, config.cache = f"folder:{root}", 123, True
    config.data_service, config.augment.crop_area_range = "grpc://localhost:5050", (0.05, 1.0)
    datasets.load_data(config).train_from(0)  # The training data is made when the run knows its step.
    config.data_service = ""
    datasets.load_data(config).train_from(0)
    assert [(k["shuffle_buffer"], k["cache"], k["crop_area_range"], k["data_service"]) for k in seen] == [
        (123, True, (0.05, 1.0), "grpc://localhost:5050"), (123, True, (0.05, 1.0), None)
    ]
    # Where the input is, recorded for the backups, where the pipeline runs here; a resumed run starts there.
    assert "positions" not in seen[0] and isinstance(seen[1]["positions"], vit_data.InputPositions)
    _, positions = datasets.load_data(config).train_from(7, {"0": [2, 5]})
    assert seen[2]["positions"] is positions and (positions.start_step, positions.start_of(0)) == (7, (2, 5))


def test_a_resumed_run_goes_on_from_the_epochs_logged_before_the_one_it_resumes_in(tmp_path):
    """The job's log of a run resumed in epoch E keeps the rows of the epochs before E (the best val_accuracy
    among them is the bar best.keras must beat; the killed-run tests run it end to end), drops the others and
    reads empty fields as NaN."""
    path = tmp_path / "log.csv"
    path.write_text("epoch,accuracy,val_accuracy\n0,0.5,0.75\n1,0.6,0.875\n2,0.7,\n")
    assert callbacks.CSVLog(str(path), first_epoch=2).read() == {
        "epoch": [0, 1], "accuracy": [0.5, 0.6], "val_accuracy": [0.75, 0.875]}
    assert callbacks.CSVLog(str(path), first_epoch=0).read() == {"epoch": [], "accuracy": [], "val_accuracy": []}
    everything = callbacks.CSVLog(str(path)).read()
    assert everything["epoch"] == [0, 1, 2] and np.isnan(everything["val_accuracy"][2])
    assert callbacks.CSVLog(str(tmp_path / "none.csv")).read() == {}
