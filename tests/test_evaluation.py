"""`keras_vit.evaluation` against scikit-learn and NumPy on fixed predictions; its files; the evaluation job."""

import json

import keras
import numpy as np
import pytest
import sklearn.metrics

import keras_vit
from keras_vit import callbacks, evaluation
from keras_vit.testing import random_images, randomize_weights
from tests.conftest import run_module, tensorboard_scalars


def fixed_predictions(n=300, classes=7, seed=0):
    """Logits that favour the true class, so that every metric is away from its trivial value; class 6 is
    never predicted (its precision is 0 by scikit-learn's zero_division=0)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    logits = rng.normal(0, 1.5, (n, classes))
    logits[np.arange(n), labels] += 1.5
    logits[:, classes - 1] -= 10.0
    return logits.astype(np.float32), labels


def test_the_report_matches_scikit_learn():
    logits, labels = fixed_predictions()
    report = evaluation.classification_report(logits, labels, class_names=list("abcdefg"))
    predicted = logits.argmax(-1)
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    assert report["examples"] == 300
    assert report["top1_accuracy"] == pytest.approx(sklearn.metrics.accuracy_score(labels, predicted), abs=1e-6)
    assert report["top5_accuracy"] == pytest.approx(sklearn.metrics.top_k_accuracy_score(labels, logits, k=5),
                                                    abs=1e-6)
    assert report["loss"] == pytest.approx(sklearn.metrics.log_loss(labels, probabilities), rel=1e-5)
    precision, recall, f1, support = sklearn.metrics.precision_recall_fscore_support(labels, predicted,
                                                                                     zero_division=0)
    per_class = report["per_class"]
    assert list(per_class) == list("abcdefg")
    np.testing.assert_allclose([per_class[c]["precision"] for c in "abcdefg"], precision, atol=1e-6)
    np.testing.assert_allclose([per_class[c]["recall"] for c in "abcdefg"], recall, atol=1e-6)
    np.testing.assert_allclose([per_class[c]["f1"] for c in "abcdefg"], f1, atol=1e-6)
    assert [per_class[c]["support"] for c in "abcdefg"] == list(support)
    assert per_class["g"]["precision"] == 0.0 and per_class["g"]["support"] > 0
    assert report["macro_f1"] == pytest.approx(sklearn.metrics.f1_score(labels, predicted, average="macro",
                                                                        zero_division=0), abs=1e-6)
    np.testing.assert_array_equal(report["confusion_matrix"], sklearn.metrics.confusion_matrix(labels, predicted))
    assert 0.3 < report["top1_accuracy"] < report["top5_accuracy"] < 1.0


def test_the_calibration_error_is_the_binned_gap_between_accuracy_and_confidence():
    logits, labels = fixed_predictions(seed=1)
    report = evaluation.classification_report(logits, labels, num_bins=10)
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    confidence, correct = probabilities.max(-1), probabilities.argmax(-1) == labels
    # Written out another way: bin b holds confidences in [b / 10, (b + 1) / 10), the last one 1.0 too.
    index = np.minimum((confidence * 10).astype(int), 9)
    expected = sum(
        np.mean(index == b) * abs(correct[index == b].mean() - confidence[index == b].mean())
        for b in range(10) if np.any(index == b)
    )
    assert report["expected_calibration_error"] == pytest.approx(expected, abs=1e-6)
    bins = report["calibration_bins"]
    assert [b["count"] for b in bins] == [int(np.sum(index == b)) for b in range(10)]
    assert sum(b["count"] for b in bins) == 300 and expected > 0.01
    # Perfectly calibrated predictions (each bin's accuracy is its confidence) have none.
    certain = np.full((4, 2), [10.0, -10.0], np.float32)
    assert evaluation.classification_report(certain, np.zeros(4))["expected_calibration_error"] < 1e-4


def test_bad_predictions_are_refused_by_name():
    logits, labels = fixed_predictions()
    with pytest.raises(ValueError, match=r"logits \(N, classes\) and N integer labels"):
        evaluation.classification_report(logits, labels[:10])
    with pytest.raises(ValueError, match=r"Labels must be in \[0, 7\). Received: labels in \[1, 9\]"):
        evaluation.classification_report(logits, np.where(labels == 0, 9, labels))
    with pytest.raises(ValueError, match="3 class names for 7 classes"):
        evaluation.classification_report(logits, labels, class_names=["a", "b", "c"])


def test_the_files_written(tmp_path):
    import tensorflow as tf

    logits, labels = fixed_predictions()
    model = randomize_weights(keras_vit.build_vit("testing", image_size=16, num_classes=7, patch_size=8,
                                                  num_heads=2), scale=0.1)
    images = random_images((40, 16, 16, 3))
    result = evaluation.evaluate(model, (images, labels[:40]), class_names=list("abcdefg"))
    np.testing.assert_allclose(result.logits, model.predict(images, verbose=0), atol=1e-6)
    paths = result.write(tmp_path / "eval")
    assert sorted(paths) == ["confusion_matrix.csv", "confusion_matrix.png", "eval.json", "reliability.png"]
    written = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert written["examples"] == 40 and written["images_per_second"] > 0
    rows = (tmp_path / "eval" / "confusion_matrix.csv").read_text().splitlines()
    assert rows[0] == "true \\ predicted,a,b,c,d,e,f,g"
    np.testing.assert_array_equal([[int(v) for v in row.split(",")[1:]] for row in rows[1:]],
                                  written["confusion_matrix"])
    for name in ("confusion_matrix.png", "reliability.png"):
        assert tf.io.decode_png(tf.io.read_file(paths[name])).shape[0] > 200
    # Past MAX_MATRIX_CLASSES classes the matrix is a CSV only; names with commas are quoted.
    many = evaluation.Evaluation(
        evaluation.classification_report(np.eye(101, dtype=np.float32), np.arange(101)),
        [f"class, {i}" for i in range(101)], None, None,
    )
    paths = many.write(tmp_path / "many")
    assert "confusion_matrix.png" not in paths
    assert (tmp_path / "many" / "confusion_matrix.csv").read_text().splitlines()[1].startswith('"class, 0",1,0')


def test_one_predict_function_serves_every_split_and_weights_loaded_later(tmp_path):
    """`predict_with_labels` traces the model once: another split (with a last batch of another size) and
    other weights loaded into the same model run the same function; the model saves and loads as before."""
    import tensorflow as tf

    model = randomize_weights(keras_vit.build_vit("testing", image_size=16, num_classes=7, patch_size=8,
                                                  num_heads=2), scale=0.1)
    images, labels = random_images((40, 16, 16, 3)), np.arange(40) % 7
    splits = [tf.data.Dataset.from_tensor_slices((images[:n], labels[:n])).batch(16) for n in (40, 21)]
    logits, read = evaluation.predict_with_labels(model, splits[0])
    np.testing.assert_allclose(logits, model.predict(images, verbose=0), atol=1e-5)
    np.testing.assert_array_equal(read, labels)
    model.save(tmp_path / "before.keras")
    (wrapper,) = model.__dict__["_keras_vit_label_predictors"].models.values()
    traced = wrapper.predict_function
    randomize_weights(model, scale=0.2, seed=1)
    logits, read = evaluation.predict_with_labels(model, splits[1])
    assert wrapper.predict_function is traced
    assert len(model.__dict__["_keras_vit_label_predictors"].models) == 1
    np.testing.assert_allclose(logits, model.predict(images[:21], verbose=0), atol=1e-5)
    np.testing.assert_array_equal(read, labels[:21])
    model.save(tmp_path / "after.keras")
    for name in ("before", "after"):
        loaded = keras.models.load_model(tmp_path / f"{name}.keras")
        assert len(loaded.weights) == len(model.weights)
    np.testing.assert_array_equal(loaded.predict(images, verbose=0), model.predict(images, verbose=0))


@pytest.mark.environment("jax")
def test_predictions_spread_over_devices_take_a_last_batch_the_devices_do_not_divide():
    """Keras' DataParallel splits every batch across the devices, and a last batch of 5 examples cannot be
    split across 2 (JAX refuses the sharding): `predict_with_labels` pads it to the first batch's size and
    answers for the 21 examples, as the model does on one device."""
    import jax
    import tensorflow as tf

    assert keras.backend.backend() == "jax" and len(jax.devices()) == 2
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        model = randomize_weights(keras_vit.build_vit("testing", image_size=16, num_classes=7, patch_size=8,
                                                      num_heads=2), scale=0.1)  # fmt: skip
        images, labels = random_images((21, 16, 16, 3)), np.arange(21) % 7
        batches = tf.data.Dataset.from_tensor_slices((images, labels)).batch(8)  # 8, 8 and 5 examples
        logits, read = evaluation.predict_with_labels(model, batches)
    finally:
        keras.distribution.set_distribution(None)
    expected = keras.ops.convert_to_numpy(model(images, training=False))
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    np.testing.assert_array_equal(read, labels)


@pytest.mark.slow
def test_the_job_evaluates_the_training_jobs_model_as_the_training_job_did(digits_job, tmp_path):
    """The training job's final evaluation and the evaluation job (its command line, as a user runs it) are the
    same code: the same numbers."""
    workdir, config, trained, _ = digits_job
    final = json.loads((workdir / "eval" / "eval.json").read_text())
    assert final["top1_accuracy"] == pytest.approx(trained["test_accuracy"])
    assert (workdir / "eval" / "confusion_matrix.png").exists() and (workdir / "eval" / "reliability.png").exists()
    stdout = run_module("experiments.evaluate", f"--model={workdir / 'model.keras'}", f"--out={tmp_path}")
    assert "images of the digits' test split: top-1" in stdout
    metrics = json.loads((tmp_path / "eval.json").read_text())
    assert metrics["top1_accuracy"] == pytest.approx(trained["test_accuracy"], abs=1e-6)
    assert metrics["top5_accuracy"] >= metrics["top1_accuracy"]
    assert metrics["examples"] == trained["test_examples"] == 360 and metrics["skipped_files"] == 0
    assert set(metrics["per_class"]) == {str(i) for i in range(10)}
    for name in ("confusion_matrix.png", "reliability.png", "confusion_matrix.csv"):
        assert (tmp_path / name).stat().st_size > 0
    # On by default: TensorBoard has each epoch's validation confusion matrix and 4 rollouts.
    assert config.tensorboard_figures == 4
    found = tensorboard_images(workdir / "tensorboard" / "validation")
    assert [step for step, _ in found["confusion_matrix"]] == list(range(trained["epochs"]))
    assert {count for _, count in found["attention_rollout"]} == {4}


@pytest.mark.slow
def test_the_job_reads_a_savedmodel_and_pretrained_weights(tmp_path):
    from experiments import evaluate as job
    from keras_vit.export import export_saved_model

    model = randomize_weights(keras_vit.build_vit("testing", image_size=16, num_classes=10, patch_size=4,
                                                  num_heads=2), scale=0.1)
    export_saved_model(model, tmp_path / "saved")
    keras_vit.save_npz(model, tmp_path / "weights.npz")
    images = random_images((4, 16, 16, 3)).astype(np.uint8)
    np.testing.assert_allclose(job.load_model(str(tmp_path / "saved")).predict(images, verbose=0),
                               model.predict(images, verbose=0), atol=1e-5)
    # An original .npz is read as the original code computes it (tanh GELU): close, not equal.
    pretrained = job.load_model(str(tmp_path / "weights.npz"))
    assert pretrained.get_layer("encoderblock_0").activation == "gelu_tanh"
    data, names, what, _ = job.evaluation_data(pretrained, "digits", "test")
    assert data[0].shape[1:] == (16, 16, 3) and names == [str(i) for i in range(10)] and "test" in what


def tensorboard_images(folder, decoded=None):
    """{tag: [(step, number of images)]} of the image summaries in the event files under `folder`; `decoded`, a
    dict if given, gets {(tag, step): the images as uint8 arrays}."""
    import glob

    import tensorflow as tf

    found = {}
    for path in sorted(glob.glob(f"{folder}/**/events.out.tfevents.*", recursive=True)):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "images":
                    pngs = value.tensor.string_val[2:]  # width, height, then the PNGs
                    images = [tf.io.decode_png(png).numpy() for png in pngs]
                    assert all(image.shape[0] > 10 for image in images)
                    found.setdefault(value.tag, []).append((event.step, len(pngs)))
                    if decoded is not None:
                        decoded[value.tag, event.step] = images
    return found


@pytest.mark.parametrize("labels", ["integer", "one_hot"])
def test_the_confusion_accuracy_is_keras_accuracy_kept_as_the_confusion_matrix(labels, tmp_path):
    """Its result is Keras' accuracy for the same labels (weighted too); its counts are the confusion matrix;
    a reset empties it; its config rebuilds it."""
    logits, integer = fixed_predictions(n=90, classes=7)
    weights = np.linspace(0.5, 2.0, 90).astype(np.float32)
    given = integer if labels == "integer" else keras.utils.to_categorical(integer, 7)
    keras_metric = keras.metrics.SparseCategoricalAccuracy() if labels == "integer" else (
        keras.metrics.CategoricalAccuracy())  # fmt: skip
    metric = evaluation.ConfusionAccuracy(7)
    for start in (0, 30, 60):  # In batches, as a training step updates it.
        metric.update_state(given[start:start + 30], logits[start:start + 30])
    np.testing.assert_array_equal(metric.confusion(), evaluation.confusion_matrix(integer, logits.argmax(-1), 7))
    assert float(metric.result()) == pytest.approx(_keras_metric_value(keras_metric, given, logits), abs=1e-7)
    metric.reset_state()
    assert metric.confusion().sum() == 0 and float(metric.result()) == 0.0
    metric.update_state(given, logits, sample_weight=weights)
    keras_metric.reset_state()
    keras_metric.update_state(given, logits, sample_weight=weights)
    assert float(metric.result()) == pytest.approx(float(keras_metric.result()), abs=1e-6)
    # Keras' callbacks in mode "auto" find that a higher value is better, as for its accuracy.
    model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(7)])
    model.compile(loss=keras.losses.CategoricalCrossentropy(from_logits=True), metrics=[metric])
    checkpoint = keras.callbacks.ModelCheckpoint(tmp_path / "best.keras", monitor="val_accuracy", save_best_only=True)
    one_hot = keras.utils.to_categorical(integer, 7)
    model.fit(logits, one_hot, validation_data=(logits, one_hot), callbacks=[checkpoint], verbose=0)
    assert checkpoint.monitor_op(0.9, 0.8)
    reloaded = keras.saving.load_model(tmp_path / "best.keras")  # Compiled with it again.
    assert reloaded.evaluate(logits, one_hot, verbose=0, return_dict=True)["accuracy"] == pytest.approx(
        model.evaluate(logits, one_hot, verbose=0, return_dict=True)["accuracy"])  # fmt: skip
    again = evaluation.ConfusionAccuracy.from_config(metric.get_config())
    assert (again.num_classes, again.name) == (7, "accuracy")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"`num_classes` must be a positive integer. Received: "
                                             rf"num_classes={bad!r}"):  # fmt: skip
            evaluation.ConfusionAccuracy(bad)


def _keras_metric_value(metric, labels, logits):
    metric.update_state(labels, logits)
    return float(metric.result())


def test_the_epoch_figures_draw_the_matrix_that_validation_counted(tmp_path, monkeypatch):
    """With a ConfusionAccuracy compiled (as the training job compiles its models), the epoch's matrix is the one
    fit's validation counted, equal to the trained model's predictions, and the split is not predicted again; an
    epoch without validation predicts it."""
    import tensorflow as tf

    model = randomize_weights(keras_vit.build_vit("testing", image_size=16, num_classes=10, patch_size=4,
                                                  num_heads=2), scale=0.1)
    model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                  metrics=[evaluation.ConfusionAccuracy(10)])  # fmt: skip
    images = random_images((96, 16, 16, 3)).astype(np.uint8)
    labels = keras.utils.to_categorical(np.arange(96) % 10, 10)
    validation = tf.data.Dataset.from_tensor_slices((images[:40], labels[:40])).batch(16)
    figures = callbacks.TensorBoardFigures(tmp_path, validation, num_images=2)
    predicted = []
    monkeypatch.setattr(callbacks.reporting, "predict_with_labels",
                        lambda *args: predicted.append(args) or evaluation.predict_with_labels(*args))  # fmt: skip
    model.fit(images, labels, epochs=2, batch_size=32, validation_data=validation, callbacks=[figures], verbose=0)
    assert predicted == []
    decoded = {}
    assert tensorboard_images(tmp_path / "validation", decoded) == {
        "confusion_matrix": [(0, 1), (1, 1)], "attention_rollout": [(0, 2), (1, 2)]
    }
    expected = evaluation.confusion_matrix(np.arange(40) % 10, model.predict(images[:40], verbose=0).argmax(-1), 10)
    np.testing.assert_array_equal(decoded["confusion_matrix", 1][0], evaluation.confusion_image(expected))
    figures.on_epoch_end(1, {"accuracy": 0.5})  # No validation logs: the counts are the training's.
    assert len(predicted) == 1


def test_tensorboard_gets_the_confusion_matrix_and_rollouts_each_epoch(tmp_path):
    """Each epoch of a run of up to 10 epochs (the default `max_figures`), spread out in a longer one."""
    import tensorflow as tf

    model = randomize_weights(keras_vit.build_vit("testing", image_size=16, num_classes=10, patch_size=4,
                                                  num_heads=2), scale=0.1)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    images = random_images((96, 16, 16, 3)).astype(np.uint8)
    labels = np.arange(96) % 10
    validation = tf.data.Dataset.from_tensor_slices((images[:40], labels[:40])).batch(16)
    figures = callbacks.TensorBoardFigures(tmp_path, validation, num_images=3)
    assert figures.examples is None  # Nothing of the validation split is read before training.
    # At most 2 epochs of the 3 get the images: every second epoch and the last.
    spaced = callbacks.TensorBoardFigures(tmp_path / "spaced", validation, num_images=1, max_figures=2)
    model.fit(images, labels, epochs=3, batch_size=32, validation_data=validation, callbacks=[figures, spaced],
              verbose=0)  # fmt: skip
    decoded = {}
    found = tensorboard_images(tmp_path / "validation", decoded)
    # The last epoch's matrix is that of the trained model's predictions of the validation split.
    predicted = model.predict(images[:40], verbose=0).argmax(-1)
    expected = evaluation.confusion_image(evaluation.confusion_matrix(labels[:40], predicted, 10))
    np.testing.assert_array_equal(decoded["confusion_matrix", 2][0], expected)
    assert found == {"confusion_matrix": [(0, 1), (1, 1), (2, 1)], "attention_rollout": [(0, 3), (1, 3), (2, 3)]}
    assert tensorboard_images(tmp_path / "spaced" / "validation") == {
        "confusion_matrix": [(1, 1), (2, 1)], "attention_rollout": [(1, 1), (2, 1)]
    }
    with pytest.raises(ValueError, match=r"`max_figures` must be a positive integer or None. Received: max_figures=0"):
        callbacks.TensorBoardFigures(tmp_path, validation, max_figures=0)
    every_epoch = callbacks.TensorBoardFigures(tmp_path, validation, max_figures=None)  # None: every epoch
    every_epoch.set_params({"epochs": 60})
    assert all(every_epoch.writes_at(epoch) for epoch in range(60))
    # Each rollout image is the image beside itself weighted by the rollout map.
    side_by_side = evaluation.rollout_images(model, images[:3])
    assert side_by_side.shape == (3, 16, 32, 3)
    np.testing.assert_array_equal(side_by_side[:, :, :16], images[:3])
    assert np.all(side_by_side[:, :, 16:] <= images[:3])


@pytest.mark.slow  # three fits: 8-11 s on 2 cores
def test_tensorboard_writes_what_keras_writes_without_a_summary_call_a_step_unless_a_writer_records_them(
    tmp_path, monkeypatch
):
    """The same epoch scalars as Keras' TensorBoard (the same weights, the same data); no summary call at the
    steps after the first when none can record; with a writer made the default around `fit`, every step's
    scalars, as Keras'."""
    import tensorflow as tf

    images = random_images((64, 16, 16, 3)).astype(np.uint8)
    labels = keras.utils.to_categorical(np.arange(64) % 10, 10)

    def fit(board, **kwargs):
        keras.utils.set_random_seed(1)
        model = keras_vit.build_vit("testing", image_size=16, num_classes=10, patch_size=4, num_heads=2)
        model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])  # fmt: skip
        model.fit(images, labels, epochs=1, batch_size=16, validation_data=(images[:16], labels[:16]),
                  callbacks=[board], verbose=0, shuffle=False, **kwargs)  # fmt: skip

    fit(keras.callbacks.TensorBoard(tmp_path / "keras"))
    calls = []
    scalar = tf.summary.scalar
    monkeypatch.setattr(tf.summary, "scalar", lambda *args, **kwargs: calls.append(args[0]) or scalar(*args, **kwargs))
    fit(callbacks.TensorBoard(tmp_path / "ours"))
    # The first step's only: Keras' own runs it, which writes the graph (write_graph=True, the default) there.
    assert calls.count("batch_loss") == 1 and calls.count("batch_accuracy") == 1, calls
    expected, got = tensorboard_scalars(tmp_path / "keras"), tensorboard_scalars(tmp_path / "ours")
    assert ("train", "epoch_loss", 0) in expected and ("validation", "epoch_accuracy", 0) in expected
    assert got.keys() == expected.keys()  # The same runs, tags and steps.
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, err_msg=str(key))

    calls.clear()
    with tf.summary.create_file_writer(str(tmp_path / "around")).as_default(step=0):
        fit(callbacks.TensorBoard(tmp_path / "recorded"))
    assert calls.count("batch_loss") == 4 and calls.count("batch_accuracy") == 4, calls  # 4 steps
