"""Predictions for a folder of images (keras_vit.prediction, python -m experiments.predict): a row per file,
the model's own numbers, bad files named with their reason, streamed, resumed."""

import csv
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from experiments import predict
from keras_vit import export, prediction
from keras_vit.data import ImageLimits, center_crop_resize
from keras_vit.testing import randomize_weights
from tests.conftest import run_command_line, run_module

CLASS_NAMES = ["zero", "one", "two, or more", "three"]


def _model(class_names=CLASS_NAMES):
    return randomize_weights(
        keras_vit.build_vit(
            "testing", image_size=32, num_classes=4, patch_size=8, num_heads=2, num_layers=2, class_names=class_names
        ),
        scale=0.3,
    )


def _folder(root):
    """A folder as users have them: photos of the model's size and of others, a grey-scale PNG, a damaged JPEG,
    a text file, a subfolder, and hidden files. Returns {file name: the uint8 RGB pixels the model should see,
    or None for a file that cannot be read as an image}."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    (root / "album").mkdir()
    (root / ".thumbnails").mkdir()
    expected = {}

    def write(name, data, pixels):
        (root / name).write_bytes(data)
        expected[name] = pixels

    square = rng.integers(0, 256, (32, 32, 3)).astype(np.uint8)
    write("a.png", tf.io.encode_png(square).numpy(), square)
    wide = tf.io.encode_jpeg(rng.integers(0, 256, (40, 64, 3)).astype(np.uint8)).numpy()
    write("album/b.jpg", wide, center_crop_resize(tf.io.decode_jpeg(wide, channels=3), (32, 32)).numpy())
    grey = rng.integers(0, 256, (32, 32, 1)).astype(np.uint8)
    write("c_grey.png", tf.io.encode_png(grey).numpy(), np.repeat(grey, 3, axis=2))
    write("d_damaged.jpg", tf.io.encode_jpeg(square).numpy()[:200], None)
    write("e_notes.txt", b"not a photo\n", None)
    (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / ".thumbnails" / "a.png").write_bytes(tf.io.encode_png(square).numpy())
    return expected


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def _check_rows(rows, root, expected, model, top_k, names=CLASS_NAMES):
    """Every file of `expected` has its row, in sorted order, with the model's own top classes and probabilities,
    or the reason it was skipped."""
    assert [row[0] for row in rows] == [str(root / name) for name in sorted(expected)]
    good = [name for name in sorted(expected) if expected[name] is not None]
    probabilities = tf.nn.softmax(model.predict(np.stack([expected[name] for name in good]), verbose=0)).numpy()
    by_name = dict(zip(good, probabilities))
    for row in rows:
        name = os.path.relpath(row[0], root)
        if expected[name] is None:
            assert row[-1] and all(cell == "" for cell in row[1:-1]), row
            continue
        assert row[-1] == "", row
        best = np.argsort(-by_name[name])[:top_k]
        assert row[1:-1:2] == [names[c] for c in best], (row, by_name[name])
        np.testing.assert_allclose([float(p) for p in row[2:-1:2]], by_name[name][best], atol=1e-6)


def test_every_file_gets_a_row_with_the_models_own_numbers_or_why_it_was_skipped(tmp_path):
    model = _model()
    expected = _folder(tmp_path / "photos")
    out = tmp_path / "predictions.csv"
    counts = predict.predict_to_csv(model, str(tmp_path / "photos"), str(out), top_k=3, batch_size=2)
    assert counts == (3, 2, 0)
    columns, rows = _read_csv(out)
    assert columns == ["path", "class_1", "probability_1", "class_2", "probability_2", "class_3", "probability_3",
                       "error"]  # fmt: skip
    _check_rows(rows, tmp_path / "photos", expected, model, top_k=3)
    errors = {os.path.basename(row[0]): row[-1] for row in rows if row[-1]}
    assert "Invalid JPEG data" in errors["d_damaged.jpg"]
    assert "Expected an encoded JPEG, PNG, GIF, BMP or WebP image; received 12 bytes" in errors["e_notes.txt"]


def test_a_stopped_run_started_again_writes_what_the_whole_run_writes(tmp_path):
    model = _model()
    _folder(tmp_path / "photos")
    whole, stopped = tmp_path / "whole.csv", tmp_path / "stopped.csv"
    predict.predict_to_csv(model, str(tmp_path / "photos"), str(whole), top_k=2, batch_size=2)
    text = whole.read_text()
    # Stopped in the middle of its third row: the header, two rows, and part of a third.
    lines = text.split("\n")
    stopped.write_text("\n".join(lines[:3]) + "\n" + lines[3][:7])
    counts = predict.predict_to_csv(model, str(tmp_path / "photos"), str(stopped), top_k=2, batch_size=2)
    assert counts == (1, 2, 2)  # c_grey (its row was cut) predicted, d_damaged and e_notes skipped; two done before
    assert stopped.read_text() == text
    # Another --top_k does not mix into the same file.
    with pytest.raises(ValueError, match="not those of this run"):
        predict.predict_to_csv(model, str(tmp_path / "photos"), str(stopped), top_k=3)
    assert stopped.read_text() == text


def test_files_are_streamed_a_few_batches_ahead_of_the_model(tmp_path):
    model = _model()
    image = tmp_path / "one.png"
    image.write_bytes(tf.io.encode_png(np.zeros((32, 32, 3), np.uint8)).numpy())
    taken = []

    def million():
        for index in range(1_000_000):
            taken.append(index)
            yield str(image)

    results = prediction.predict_files(model, million(), top_k=1, batch_size=8)
    first = [next(results) for _ in range(20)]
    assert all(result.error is None and result.names == (first[0].names[0],) for result in first)
    # A few batches and the parallel reads in flight, not the listing.
    assert 20 <= len(taken) < 500, len(taken)
    results.close()


def test_the_listing_walks_folders_globs_and_other_file_systems_in_a_fixed_order(tmp_path):
    expected = _folder(tmp_path / "photos")
    photos = tmp_path / "photos"
    assert list(prediction.list_files(photos)) == [str(photos / name) for name in sorted(expected)]
    assert list(prediction.list_files(f"{photos}/*.png")) == [str(photos / "a.png"), str(photos / "c_grey.png")]
    assert list(prediction.list_files(photos / "a.png")) == [str(photos / "a.png")]
    with pytest.raises(FileNotFoundError, match="nowhere"):
        prediction.list_files(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"No file matches .*\*\.webp"):
        prediction.list_files(f"{photos}/*.webp")
    # A file system that tf.io.gfile reaches by URL, as gs:// is (this one in memory).
    for name in ("b/2.png", "a.png", "b/1.png", ".hidden"):
        tf.io.gfile.makedirs(os.path.dirname(f"ram://listing/{name}"))
        with tf.io.gfile.GFile(f"ram://listing/{name}", "wb") as f:
            f.write(b"x")
    assert list(prediction.list_files("ram://listing")) == ["ram://listing/a.png", "ram://listing/b/1.png",
                                                             "ram://listing/b/2.png"]  # fmt: skip


def test_a_name_that_is_not_utf8_is_skipped_and_named(tmp_path):
    model = _model()
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "good.png").write_bytes(tf.io.encode_png(np.zeros((32, 32, 3), np.uint8)).numpy())
    with open(os.path.join(os.fsencode(folder), b"caf\xe9.png"), "wb") as f:
        f.write(tf.io.encode_png(np.zeros((32, 32, 3), np.uint8)).numpy())
    results = list(prediction.predict_files(model, prediction.list_files(str(folder)), top_k=1))
    assert [(os.path.basename(r.path), r.error) for r in results] == [
        ("caf\\xe9.png", "its name is not UTF-8: rename it to read it"), ("good.png", None),
    ]  # fmt: skip


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    model = _model(class_names=None)
    _folder(tmp_path / "photos")
    with pytest.raises(ValueError, match=r"`top_k` must be an integer in \[1, 4\]. Received: top_k=5"):
        predict.predict_to_csv(model, str(tmp_path / "photos"), str(tmp_path / "p.csv"), top_k=5)
    assert not (tmp_path / "p.csv").exists() or (tmp_path / "p.csv").read_text() == ""
    with pytest.raises(ValueError, match="must be a local file"):
        predict.predict_to_csv(model, str(tmp_path / "photos"), "gs://bucket/p.csv")
    printed = run_command_line(
        "experiments.predict", f"--model={tmp_path / 'missing.keras'}", f"--images={tmp_path / 'photos'}",
        f"--out={tmp_path / 'q.csv'}", exit_code=2,
    )  # fmt: skip
    assert not (tmp_path / "q.csv").exists(), printed
    # A model without class names: the class indices stand for them.
    predict.predict_to_csv(model, str(tmp_path / "photos" / "a.png"), str(tmp_path / "r.csv"), top_k=4)
    _, rows = _read_csv(tmp_path / "r.csv")
    assert sorted(rows[0][1:-1:2]) == ["0", "1", "2", "3"]


@pytest.mark.slow  # two exports and the job as a program: about 20 s
def test_the_job_predicts_with_a_keras_file_and_with_the_savedmodel_as_it_serves(tmp_path):
    model = _model()
    expected = _folder(tmp_path / "photos")
    model.save(tmp_path / "model.keras")
    stdout, stderr = run_module(
        "experiments.predict", f"--model={tmp_path / 'model.keras'}", f"--images={tmp_path / 'photos'}",
        f"--out={tmp_path / 'keras.csv'}", "--top_k=2", stderr=True,
    )  # fmt: skip
    assert "3 images predicted" in stdout and "2 files skipped" in stdout, stdout
    assert "Traceback" not in stderr and "5 files: 3 predicted, 2 skipped" in stderr, stderr[-2000:]
    _check_rows(_read_csv(tmp_path / "keras.csv")[1], tmp_path / "photos", expected, model, top_k=2)
    # The SavedModel prepares each file in its own graph (serving_bytes) and names the classes from its labels.
    saved = export.export_saved_model(keras.saving.load_model(tmp_path / "model.keras"), tmp_path / "sm",
                                      default_signature="bytes")  # fmt: skip
    counts = predict.predict_to_csv(predict.prediction_model(saved), str(tmp_path / "photos"),
                                    str(tmp_path / "sm.csv"), top_k=2, batch_size=2)  # fmt: skip
    assert counts == (3, 2, 0)
    _check_rows(_read_csv(tmp_path / "sm.csv")[1], tmp_path / "photos", expected, model, top_k=2)
    # A SavedModel whose own limits are tighter than the pipeline's: the image it refuses is named, the rest served.
    small = export.export_saved_model(model, tmp_path / "small", image_limits=ImageLimits(32 * 32))
    results = list(prediction.predict_files(str(small), prediction.list_files(tmp_path / "photos"), batch_size=8))
    refused = {os.path.basename(r.path): r.error for r in results if r.error}
    assert set(refused) == {"b.jpg", "d_damaged.jpg", "e_notes.txt"} and "max_pixels" in refused["b.jpg"], refused
    # Loaded once (load_saved_model), it serves run after run as its folder does, class names included.
    loaded = prediction.load_saved_model(saved)
    by_folder = list(prediction.predict_files(str(saved), prediction.list_files(tmp_path / "photos"), top_k=2))
    for _ in range(2):
        again = list(prediction.predict_files(loaded, prediction.list_files(tmp_path / "photos"), top_k=2))
        assert [(r.path, r.names, r.error) for r in again] == [(r.path, r.names, r.error) for r in by_folder]
        np.testing.assert_allclose([r.probabilities for r in again if not r.error],
                                   [r.probabilities for r in by_folder if not r.error], rtol=1e-5)  # fmt: skip
    # A SavedModel that is not export_saved_model's: refused, naming the signatures it has.
    plain = tf.Module()
    plain.f = tf.function(lambda x: x + 1, input_signature=[tf.TensorSpec([None], tf.float32)])
    tf.saved_model.save(plain, str(tmp_path / "plain"), signatures={"add": plain.f})
    with pytest.raises(ValueError, match=r"no `serving_bytes` signature \(it has \['add'\]\)"):
        prediction.load_saved_model(tmp_path / "plain")
