"""`python -m experiments.benchmark --mode=input`: the input pipelines' forms take turns, the figures are the
medians and ratios stated, the photo folder, and the peer's augmentation plugged in."""

import glob
import itertools
import os
import sys

import numpy as np
import pytest

from experiments.benchmark import inputs, results


class RecordedPipeline:
    """An iterable of endless "batches" that records in `log` each iterator it opens and each batch taken."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __iter__(self):
        self.log.append(("open", self.name))
        while True:
            self.log.append(("batch", self.name))
            yield self.name


def test_input_forms_take_turns_each_in_a_fresh_iterator():
    log = []
    pipelines = {name: RecordedPipeline(name, log) for name in ("crop_flip", "keras_vit", "model_garden")}
    timings = inputs.time_turns(pipelines, batches_per_turn=3, warmup_batches=2, repeats=2, first_turn_batches=4)
    # One untimed turn each (a pass over the files and the warm-up), then the timed turns, in the same order.
    opened = [name for event, name in log if event == "open"]
    assert opened == ["crop_flip", "keras_vit", "model_garden"] * 3
    taken = [sum(1 for _ in group) for _, group in itertools.groupby(log, key=lambda event: event)]
    assert taken == [1, 4 + 2] * 3 + [1, 2 + 3] * 6
    assert {name: len(turns) for name, turns in timings.items()} == dict.fromkeys(pipelines, 2)
    assert all(seconds > 0 and cpu >= 0 for turns in timings.values() for seconds, cpu in turns)


def test_input_figures_are_the_medians_and_ratios_stated():
    """From made-up turns of 100 images on 4 cores: medians per form, then the ratios and the added cost."""
    timings = {
        "crop_flip": [(0.5, 1.6), (0.25, 0.9), (1.0, 2.0)],  # 200, 400, 100 images/s; 16, 9, 20 ms of CPU an image
        "keras_vit": [(1.0, 3.0), (0.625, 2.0), (0.5, 1.5)],  # 100, 160, 200 images/s
        "model_garden": [(2.0, 7.0), (1.6, 6.0), (1.25, 5.0)],  # 50, 62.5, 80 images/s
    }
    figures, ratios = inputs.summarize(timings, images_per_turn=100, cores=4)
    assert figures["images_per_second"] == {"crop_flip": 200, "keras_vit": 160, "model_garden": 62.5}
    assert figures["images_per_second_per_core"] == {"crop_flip": 50, "keras_vit": 40, "model_garden": 15.625}
    assert figures["cpu_seconds_per_image"] == pytest.approx({"crop_flip": 0.016, "keras_vit": 0.02,
                                                              "model_garden": 0.06})  # fmt: skip
    assert figures["cores_per_1000_images_per_second"] == pytest.approx({"crop_flip": 16, "keras_vit": 20,
                                                                         "model_garden": 60})  # fmt: skip
    assert figures["busy_cores"] == pytest.approx({"crop_flip": 3.2, "keras_vit": 3.0, "model_garden": 3.75})
    assert figures["ours"] == "keras_vit" and figures["cores"] == 4
    # (1/160 - 1/200) / (1/200): RandAugment adds a quarter to decode + crop + flip's time; 20 / 16 ms of CPU.
    assert figures["randaugment_added_cost"] == pytest.approx(0.25)
    assert figures["randaugment_added_cpu_time"] == pytest.approx(0.25)
    assert figures["cpu_time_ratios"] == pytest.approx({"crop_flip": 0.8, "model_garden": 3})
    assert ratios == {
        "crop_flip": {"ratio": pytest.approx(0.8), "against": "crop_flip"},
        "model_garden": {"ratio": pytest.approx(2.56), "against": "model_garden"},
    }


def test_input_photo_folder_holds_distinct_crops_of_the_photos(tmp_path):
    import tensorflow as tf

    root = inputs.write_photo_folder(str(tmp_path), 2 * len(inputs.PHOTOS), (50, 40))
    paths = sorted(glob.glob(os.path.join(root, "class*", "*.jpg")), key=lambda p: int(os.path.basename(p)[:-4]))
    images = [tf.io.decode_jpeg(tf.io.read_file(path)).numpy() for path in paths]
    # Landscape (width 50, height 40), every fourth one portrait.
    assert [image.shape for image in images] == [(50, 40, 3) if i % 4 == 0 else (40, 50, 3) for i in range(14)]
    # The same photo twice (i and i + 7), cropped differently.
    assert all(not np.array_equal(images[i], images[i + len(inputs.PHOTOS)]) for i in range(len(inputs.PHOTOS)))
    assert all(image.std() > 10 for image in images)  # Photos, not flat fills.


@pytest.fixture
def tiny_jpegs(tmp_path):
    return inputs.write_synthetic_folder(str(tmp_path / "jpegs"), 12, (48, 40))


@pytest.mark.slow  # Timed turns of three pipelines: 6 s alone, up to 19 s beside another worker.
def test_input_benchmark_plugs_a_callable_augmentation_in_as_the_peer(tiny_jpegs, monkeypatch, capsys):
    """A stand-in for Model Garden's RandAugment goes through the same path as the peer: the pipeline
    calls it on every image of its form's batches, and the row holds its figures and ratio."""
    import tensorflow as tf

    calls = []

    def invert(image):
        calls.append(image.shape)
        return 255 - image

    def peer(image, seed):
        assert image.dtype == tf.uint8 and seed.shape == (2,)
        return tf.ensure_shape(tf.numpy_function(invert, [image], tf.uint8), image.shape)

    monkeypatch.setattr(inputs, "model_garden_randaugment", lambda num_ops, magnitude: (peer, None))
    measured = inputs.input_benchmark(32, 4, repeats=2, data=tiny_jpegs, randaugment=["2", "10"], input_images=8)
    figures, ratios = measured["figures"], measured["ratios"]
    forms = ["crop_flip", "keras_vit", "model_garden"]
    assert list(figures["images_per_second"]) == forms and figures["ours"] == "keras_vit"
    # Its untimed turn (warm-up 2 batches + a pass over the 10 training files: 3 batches), then 2 turns of
    # 2 + 2 batches of 4 images: the stand-in saw at least those 52 images, each 32x32 after the crop.
    assert len(calls) >= 4 * (2 + 3 + 2 * (2 + 2))
    assert set(calls) == {(32, 32, 3)}
    rates = figures["images_per_second"]
    assert ratios["model_garden"] == {"ratio": rates["keras_vit"] / rates["model_garden"], "against": "model_garden"}
    assert figures["randaugment_added_cost"] == pytest.approx(rates["crop_flip"] / rates["keras_vit"] - 1)
    cpu = figures["cpu_seconds_per_image"]
    assert figures["cpu_time_ratios"]["model_garden"] == pytest.approx(cpu["model_garden"] / cpu["keras_vit"])
    assert "not_measured" not in figures and "versions" in measured
    stdout = capsys.readouterr().out
    assert "+ Model Garden's RandAugment(2, 10) " in stdout and "keras_vit / model_garden: " in stdout


@pytest.mark.slow  # Timed turns of the pipelines, as the one above.
def test_input_benchmark_without_model_garden_says_why_and_measures_the_rest(tiny_jpegs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "official", None)  # `import official...` raises ImportError.
    peer, note = inputs.model_garden_randaugment(2, 10)
    assert peer is None
    assert note.startswith("Model Garden's RandAugment not measured: `from official.vision.ops import augment` failed")
    assert "docs/performance.md" in note
    measured = inputs.input_benchmark(32, 4, repeats=1, data=tiny_jpegs, input_images=4)
    figures = measured["figures"]
    assert list(figures["images_per_second"]) == ["crop_flip", "keras_vit"]
    assert list(measured["ratios"]) == ["crop_flip"]
    assert figures["not_measured"] == note and note in capsys.readouterr().out
    row = results.make_row("input", {"image_size": 32, "repeats": 1}, measured, argv=["benchmark", "--mode=input"])
    assert set(row) <= set(results.FIELDS) | {"backend", "dirty"} and row["figures"]["data"] == f"folder {tiny_jpegs}"
    assert row["figures"]["cached"] is False  # A folder of one's own is read from its files.
    # Without --randaugment, decode + crop + flip alone; the folder it writes is kept in memory.
    figures = inputs.input_benchmark(
        32, 4, repeats=1, synthetic="gradients", synthetic_images=12, synthetic_size="48x40", randaugment=[],
        input_images=4,
    )["figures"]  # fmt: skip
    assert list(figures["images_per_second"]) == ["crop_flip"] and "randaugment_added_cost" not in figures
    assert figures["data"] == "12 48x40 synthetic JPEGs" and figures["cached"] is True


