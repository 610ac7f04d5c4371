import collections
import os

import numpy as np
import pytest
import tensorflow as tf

from keras_vit import data as vit_data
from tests.builders import HEIGHT, WIDTH, bad_images, prepare_tfds, write_folder, write_odd_folder

# === Images in every format a folder of photos holds, and files that are not images ===

def identify(image, good):
    """The path of the good image `image` decodes (the closest), and its largest error."""
    errors = {path: np.abs(image.astype(int) - expected.astype(int)).max() for path, (expected, _, _) in good.items()}
    path = min(errors, key=errors.get)
    return path, errors[path]


def test_odd_formats_decode_to_rgb_and_bad_files_are_skipped_and_named(tmp_path):
    good, bad = write_odd_folder(tmp_path / "odd")
    source = vit_data.load_folder(tmp_path / "odd")
    # Listed by name only: the bad files are found when decoded, notes.txt and Thumbs.db never.
    assert (source.num_train, source.num_test) == (len(good) + len(bad), 3)
    assert source.skipped.count == 0

    # Two passes of the shuffled training files: each good image exactly once per pass, as written.
    seen = collections.Counter()
    for image, label in source.decoded("train", shuffle=True, seed=3).repeat(2).as_numpy_iterator():
        assert image.shape == (HEIGHT, WIDTH, 3) and image.dtype == np.uint8
        path, error = identify(image, good)
        expected, tolerance, expected_label = good[path]
        assert error <= tolerance, (path, error)
        assert label == expected_label, path
        seen[path] += 1
    # Tolerance 0 for the 16-bit PNGs: scaled to their high byte; a wrap would give the low byte, 200.
    assert seen == {path: 2 for path in good}

    assert sorted(source.skipped.paths) == sorted(bad)
    assert source.skipped.count == len(bad)  # each named once, though met twice
    errors = source.skipped.errors
    # TIFF's "II*\0", named in hex: not a format decode_image reads.
    assert "JPEG, PNG, GIF, BMP or WebP image; received" in errors[next(p for p in bad if p.endswith("tiff.jpg"))]
    assert "starting with 49 49 2a 00" in errors[next(p for p in bad if p.endswith("tiff.jpg"))]
    assert "image; received 0 bytes." in errors[next(p for p in bad if p.endswith("empty.gif"))]
    assert all(errors[p] for p in bad)

    # Evaluation: in order, the corrupt test file skipped and named too.
    assert [int(y) for _, y in source.test.as_numpy_iterator()] == [0, 1]
    assert str(tmp_path / "odd" / "test" / "b" / "broken.png") in source.skipped.paths


def test_the_training_pipeline_gives_each_good_image_once_per_epoch(tmp_path):
    good, bad = write_odd_folder(tmp_path / "odd")
    source = vit_data.load_folder(tmp_path / "odd")
    size, batch = (HEIGHT, WIDTH), len(good)  # one batch per pass: no crop, no flip, no resize
    ds = vit_data.training_pipeline(source, size, batch, seed=0, crop=False, flip=False)
    epochs = []
    for images, labels in ds.take(3).as_numpy_iterator():
        assert images.dtype == np.uint8 and labels.shape == (batch, 2)
        found = [identify(image, good) for image in images]
        assert all(error <= good[path][1] for path, error in found)
        assert [good[path][2] for path, _ in found] == list(labels.argmax(-1))
        epochs.append(sorted(path for path, _ in found))
    assert epochs == [sorted(good)] * 3
    assert sorted(source.skipped.paths) == sorted(bad)


def test_file_sharding_gives_each_input_pipeline_its_own_files(tmp_path):
    """Two input pipelines (hosts): disjoint files that together are all; each one decodes (and so
    skips and names) only the bad files of its own share."""
    good, bad = write_odd_folder(tmp_path / "odd")
    seen, skipped = [], []
    for index in range(2):
        source = vit_data.load_folder(tmp_path / "odd")  # a host of its own
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=index, num_replicas_in_sync=2)
        images = list(source.decoded("train", input_context=context, shuffle=True, seed=0).as_numpy_iterator())
        seen.append({identify(image, good)[0] for image, _ in images})
        assert len(seen[-1]) == len(images)
        skipped.append(set(source.skipped.paths))
        # Batched per replica: the global batch of 8 is 4 on each of the two replicas.
        ds = vit_data.training_pipeline(source, 8, 8, context, crop=False, flip=False)
        assert ds.element_spec[0].shape == (4, 8, 8, 3)
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(good)
    assert not skipped[0] & skipped[1] and skipped[0] | skipped[1] == set(bad)
    assert all(seen) and all(skipped)


def test_a_split_where_every_file_fails_is_an_error_not_an_endless_loop(tmp_path):
    corrupt = ["a/x.png", "b/y.png", "a/z.jpg", "b/w.jpg"]
    source = vit_data.load_folder(write_folder(tmp_path / "bad", ("a", "b"), 0, corrupt=corrupt), test_fraction=0.5)
    ds = vit_data.training_pipeline(source, 8, 1)  # endless: without the check it would spin forever
    failed = r"All 2 examples of the train split failed .*Expected an encoded JPEG"
    with pytest.raises(tf.errors.InvalidArgumentError, match=failed):
        next(iter(ds))
    assert source.skipped.count == 2
    two = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=2)
    with pytest.raises(ValueError, match="No examples in the train split read by input pipeline 2 of 3"):
        source.decoded("train", input_context=two)


def test_folder_with_a_corrupt_file_is_skipped_and_counted(tmp_path):
    root = write_folder(tmp_path / "images", corrupt=["dog/broken.jpg"])
    source = vit_data.load_folder(root, test_fraction=0.25, seed=1)
    assert source.class_names == ["cat", "dog", "eel"] and source.num_classes == 3
    assert source.num_train + source.num_test == 19  # listed, not opened
    images = list(source.train.as_numpy_iterator()) + list(source.test.as_numpy_iterator())
    assert len(images) == 18 and all(x.shape == (40, 30, 3) for x, _ in images)
    assert source.skipped.paths == [f"{root}/dog/broken.jpg"] and source.skipped.count == 1
    train = vit_data.image_pipeline(source.train, 16, 4, training=True, num_classes=3)
    batches = list(train)
    assert len(batches) == sum(1 for _ in source.train) // 4
    assert batches[0][0].shape == (4, 16, 16, 3) and batches[0][0].dtype == tf.uint8


def test_train_and_test_subfolders_are_the_splits(tmp_path):
    write_folder(tmp_path / "ds" / "train", per_class=4)
    write_folder(tmp_path / "ds" / "test", per_class=2)
    source = vit_data.load_folder(tmp_path / "ds")
    assert (source.num_train, source.num_test) == (12, 6)


def test_bad_folders(tmp_path):
    with pytest.raises(ValueError, match="No folder at"):
        vit_data.load_folder(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No class subfolders"):
        vit_data.load_folder(tmp_path / "empty")
    (tmp_path / "notes" / "a").mkdir(parents=True)
    (tmp_path / "notes" / "a" / "readme.txt").write_text("no images here")
    with pytest.raises(ValueError, match=r"No images in .*notes.*: none of its subfolders \['a'\] holds a file named"):
        vit_data.load_folder(tmp_path / "notes")
    with pytest.raises(ValueError, match="`split` must be 'train' or 'test'. Received: split='validation'"):
        vit_data.load_folder(write_folder(tmp_path / "ok")).decoded("validation")


def test_the_same_seed_gives_the_same_first_batch(tmp_path):
    source = vit_data.load_folder(write_folder(tmp_path / "images"), seed=0)

    def first(seed):
        ds = vit_data.image_pipeline(source.train, 24, 8, training=True, num_classes=3, seed=seed)
        return next(iter(ds))

    (x1, y1), (x2, y2), (x3, _) = first(3), first(3), first(4)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(x1, x3)
    # And the next epoch of one pipeline sees other crops.
    ds = vit_data.image_pipeline(source.train, 24, 8, training=True, num_classes=3, seed=3)
    assert not np.array_equal(next(iter(ds))[0], next(iter(ds))[0])
    # The training pipeline (shuffled before decoding) too.
    first_batches = [
        next(iter(vit_data.training_pipeline(source, 24, 8, seed=seed)))[0].numpy() for seed in (3, 3, 4)
    ]
    np.testing.assert_array_equal(first_batches[0], first_batches[1])
    assert not np.array_equal(first_batches[0], first_batches[2])


def test_randaugment_keeps_uint8_and_evaluation_keeps_every_example(tmp_path):
    """Batch mixing (MixUp/CutMix) is not the input pipeline's: pixels stay uint8, labels one-hot."""
    source = vit_data.load_folder(write_folder(tmp_path / "images"), seed=0)
    ds = vit_data.image_pipeline(source.train, 16, 4, training=True, num_classes=3, randaugment=(2, 10))
    x, y = next(iter(ds))
    assert x.shape == (4, 16, 16, 3) and x.dtype == tf.uint8
    assert set(np.unique(y)) <= {0.0, 1.0} and np.all(tf.reduce_sum(y, -1) == 1.0)
    evaluation = vit_data.image_pipeline(source.test, 16, 5, training=False, num_classes=3)
    assert sum(len(y) for _, y in evaluation) == source.num_test  # every example kept


def test_crop_flip_resize_is_seeded_and_resizes_and_flips_as_told():
    image = tf.constant(np.random.default_rng(0).integers(0, 256, (20, 30, 3)), tf.uint8)
    resized = tf.cast(tf.clip_by_value(tf.round(tf.image.resize(image, (8, 12), antialias=True)), 0, 255), tf.uint8)
    plain = vit_data.crop_flip_resize(image, tf.constant([1, 2]), (8, 12), crop=False, flip=False)
    assert plain.dtype == tf.uint8
    np.testing.assert_array_equal(plain, resized)
    # The flip alone: each seed gives the resized image or its mirror, and over 16 seeds both.
    flipped = [vit_data.crop_flip_resize(image, tf.constant([0, s]), (8, 12), crop=False).numpy() for s in range(16)]
    mirrored = [np.array_equal(x, resized.numpy()[:, ::-1]) for x in flipped]
    assert all(m or np.array_equal(x, resized) for m, x in zip(mirrored, flipped)) and 0 < sum(mirrored) < 16
    # The crop: the same seed, the same image; another seed, another.
    crops = [vit_data.crop_flip_resize(image, tf.constant(s), (8, 12)).numpy() for s in ([3, 4], [3, 4], [5, 4])]
    assert all(x.shape == (8, 12, 3) for x in crops)
    np.testing.assert_array_equal(crops[0], crops[1])
    assert not np.array_equal(crops[0], crops[2])


def test_randaugment_is_seeded_and_keeps_uint8():
    image = tf.constant(np.random.default_rng(0).integers(0, 256, (20, 30, 3)), tf.uint8)
    runs = {}
    for name, seed in (("a", 1), ("again", 1), ("b", 2)):
        rand_augment = vit_data.make_randaugment(2, 10, seed=seed)
        runs[name] = [rand_augment(image).numpy() for _ in range(3)]
    assert all(x.dtype == np.uint8 and x.shape == (20, 30, 3) for x in runs["a"])
    # The same seed gives the same sequence of images; each call draws anew, and another seed differs.
    assert all(np.array_equal(x, y) for x, y in zip(runs["a"], runs["again"]))
    assert not any(np.array_equal(x, image.numpy()) for x in runs["a"])
    assert not np.array_equal(runs["a"][0], runs["a"][1])
    # Another seed, other draws (two draws can still agree: AutoContrast does not depend on the seed).
    assert not all(np.array_equal(x, y) for x, y in zip(runs["a"], runs["b"]))


# The names `keras_vit.data` had as one module; the jobs, tests and docs use them from the package.
FORMER_NAMES = {
    "Dataset", "DecodeFailures", "IMAGE_EXTENSIONS", "IMAGE_MAGIC", "ImageSource", "NAMED_IN_A_ROW", "Split",
    "center_crop_resize", "decode_image", "decode_skipping_failures", "image_pipeline", "inception_crop",
    "load_digits", "load_folder", "load_image_source", "load_tfds", "make_pipeline", "random_translate",
    "training_pipeline",
}


def test_keras_vit_data_exports_every_public_name_of_its_modules():
    import importlib
    import types

    exported = set(vit_data.__all__)
    assert FORMER_NAMES <= exported, FORMER_NAMES - exported
    found = set()
    for name in ("augment", "decode", "digits", "folders", "header", "image_source", "pipeline", "positions",
                 "randaugment", "tfds"):
        module = importlib.import_module(f"keras_vit.data.{name}")
        public = {
            key for key, value in vars(module).items()
            if not key.startswith("_") and not isinstance(value, types.ModuleType)
            and getattr(value, "__module__", module.__name__) == module.__name__  # defined here, not imported
        }
        assert all(getattr(vit_data, key) is getattr(module, key) for key in public), name
        found |= public
    assert found | {"load_image_source"} == exported  # The loader by name is the package's own.
    assert vit_data.load_image_source.__module__ == "keras_vit.data"


def test_tfds_by_name_with_data_dir(tmp_path):
    """A TFDS set loaded by name from data_dir, its images decoded by `decode_image`."""
    root = write_folder(tmp_path / "files", per_class=4)
    names = ["cat", "dog", "eel"]
    files = {
        "train": [
            (c, root / name / f"{i}.{'png' if i % 2 else 'jpg'}") for c, name in enumerate(names) for i in range(3)
        ],
        "test": [(c, root / name / "3.png") for c, name in enumerate(names)],
    }
    data_dir = prepare_tfds(tmp_path, files)
    source = vit_data.load_tfds("tiny_colours", data_dir=data_dir)
    assert source.num_classes == 3 and source.class_names == names
    assert (source.num_train, source.num_test) == (9, 3)
    ds = vit_data.image_pipeline(source.train, 32, 3, training=True, num_classes=3)
    x, y = next(iter(ds))
    assert x.shape == (3, 32, 32, 3) and y.shape == (3, 3)
    expected = tf.io.decode_png((root / "eel" / "3.png").read_bytes()).numpy()
    test = {int(y): x for x, y in source.test.as_numpy_iterator()}  # TFDS stores them in its own order
    np.testing.assert_array_equal(test[2], expected)
    for name in ("tiny_colours", "mnist"):  # unknown to TFDS here; a TFDS builder, not prepared
        with pytest.raises(ValueError, match=f"TFDS data set '{name}' is not prepared in data_dir=.*elsewhere"):
            vit_data.load_tfds(name, data_dir=str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("num_shards", [None, 2])
def test_tfds_records_that_fail_to_decode_are_skipped_and_named_and_sharded(tmp_path, num_shards):
    """Odd formats stored as they are decode; corrupt records are skipped and named by TFDS id.
    Two input pipelines read disjoint examples: by file with 2 shards, by even ranges with 1."""
    good, bad = write_odd_folder(tmp_path / "odd")
    train = [(good[p][2], p) for p in sorted(good)] + [(i % 2, p) for i, p in enumerate(sorted(bad)[:3])]
    data_dir = prepare_tfds(tmp_path, {"train": train, "test": train[:2]}, num_shards)
    source = vit_data.load_tfds("tiny_colours", data_dir=data_dir)
    assert source.num_train == len(good) + 3

    seen = []
    for image, label in source.train.as_numpy_iterator():
        path, error = identify(image, good)
        assert error <= good[path][1] and label == good[path][2], path
        seen.append(path)
    assert sorted(seen) == sorted(good)
    assert source.skipped.count == 3 and all("tfrecord" in name for name in source.skipped.paths)
    assert all(source.skipped.errors.values())

    shares = []
    for index in range(2):
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=index, num_replicas_in_sync=2)
        ds = source.decoded("train", input_context=context, shuffle=True, seed=0)
        shares.append([identify(image, good)[0] for image, _ in ds.as_numpy_iterator()])
    assert all(shares) and not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == sorted(good)


def test_input_benchmark_reports_images_per_second(tmp_path):
    from experiments import benchmark

    root = benchmark.write_synthetic_folder(str(tmp_path / "jpegs"), 12, (48, 40))
    source = vit_data.load_folder(root, test_fraction=0.25)
    rate = benchmark.input_rate(source, 32, 3, (2, 5), repeats=2, images_per_repeat=6, what="test")
    assert rate > 0


# === The job, end to end, on a folder with bad files ===

def train_on_folder(root, workdir, tensorboard_figures=True):
    """The training job on an image folder: a small model, 2 epochs, RandAugment in the pipeline; the per-epoch
    TensorBoard figures (which read the validation split) as by default, or off."""
    from experiments import train
    from experiments.configs import digits

    config = digits.get_config()
    config.dataset = f"folder:{root}"
    config.image_size, config.batch_size, config.epochs, config.warmup_epochs = 16, 8, 2, 1
    if not tensorboard_figures:
        config.tensorboard_figures = 0
    config.model.update(patch_size=8, num_layers=1, hidden_dim=32, num_heads=2, mlp_dim=64)
    config.label_smoothing = 0.0
    config.augment.randaugment = (2, 5)
    config.visualize = False
    config.jit_compile = "off"  # What is checked is the input; XLA's compile would outlast the training.
    return train.train_and_evaluate(config, str(workdir))


def write_separable_folder(root, bad=False):
    """Three classes of solid colours with noise (train 12, test 6 per class), with or without the bad files."""
    rng = np.random.default_rng(0)
    colours = [(220, 40, 40), (40, 220, 40), (40, 40, 220)]
    for split, count in (("train", 12), ("test", 6)):
        for c, colour in enumerate(colours):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                image = np.clip(rng.normal(colour, 30, (24, 20, 3)), 0, 255).astype(np.uint8)
                (folder / f"{i}.png").write_bytes(tf.io.encode_png(image).numpy())
    if bad:
        for i, (name, data) in enumerate(bad_images().items()):
            (root / ("train" if i % 4 else "test") / f"class{i % 3}" / name).write_bytes(data)
    return root


@pytest.mark.slow
def test_training_on_a_folder_with_bad_files_matches_the_clean_folder(tmp_path, caplog):
    """The bad files (corrupt, truncated, wrong format; in both splits) are skipped and named in the
    log, and the job reaches the accuracy of the same folder without them: 100% on this separable
    set, both (reached from the first epoch: the check is that the bad files change nothing, the
    unit tests above check what each epoch holds).  The per-epoch TensorBoard figures read the validation
    split, bad files included, in the run on the bad folder; the clean folder's run, the reference, is the
    same job without them (they neither train nor change what is compared)."""
    import logging

    folders = [write_separable_folder(tmp_path / f"images{bad}", bad=bad) for bad in (False, True)]
    metrics, logs = [], []
    for index, folder in enumerate(folders):
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            metrics.append(train_on_folder(folder, tmp_path / f"run{index}", tensorboard_figures=index == 1))
            logs.append(caplog.text)
    results = dict(zip((False, True), metrics))
    assert "could not be read or decoded" not in logs[0]
    for name in bad_images():
        assert f"/{name}: it could not be read or decoded" in logs[1], name
    # metrics.json names them too (each at most once, whichever pass met it first).
    assert results[False]["skipped_files"] == 0 and results[True]["skipped_files"] == len(bad_images())
    assert sorted(path.rsplit("/", 1)[1] for path in results[True]["skipped_examples"]) == sorted(bad_images())
    listed = [
        sum(results[bad][f"{split}_examples"] for split in ("train", "validation", "test")) for bad in (False, True)
    ]
    assert listed == [54, 54 + len(bad_images())], listed
    accuracies = [results[bad]["test_accuracy"] for bad in (False, True)]
    assert accuracies == [1.0, 1.0], accuracies
    steps = [results[bad]["steps"] for bad in (False, True)]
    # Listed training files (the bad ones too) // batch, per epoch.
    assert steps == [2 * (results[bad]["train_examples"] // 8) for bad in (False, True)], steps
    assert results[True]["train_examples"] > results[False]["train_examples"]


def photo(height=120, width=160, seed=0):
    """A smooth photo-like image (gradients plus a little noise): what JPEG is made for."""
    rows, columns = np.mgrid[0:height, 0:width]
    base = np.stack([columns * 255 / width, rows * 255 / height, (rows + columns) * 127 / (height + width)], -1)
    noise = np.random.default_rng(seed).normal(0, 6, base.shape)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def test_decode_and_crop_is_the_inception_crop_of_the_decoded_image_and_decodes_a_jpeg_inside_it():
    image = photo()
    jpeg = tf.io.encode_jpeg(image, quality=95)
    png = tf.io.encode_png(image)
    shapes = set()
    for seed in ([1, 2], [3, 4], [5, 6]):
        seed = tf.constant(seed)
        expected = vit_data.inception_crop(vit_data.decode_image(jpeg), seed).numpy()
        got = vit_data.decode_and_crop(jpeg, seed).numpy()
        assert got.shape == expected.shape
        shapes.add(got.shape)
        # libjpeg decodes whole blocks around the window: the same pixels, up to the chroma upsampling at its
        # edges (at most a few levels on this image).
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= 4, seed
        np.testing.assert_array_equal(
            vit_data.decode_and_crop(png, seed), vit_data.inception_crop(vit_data.decode_image(png), seed)
        )
    assert len(shapes) == 3 and image.shape not in shapes  # three crops, each smaller than the image
    # The JPEG branch decodes with DecodeAndCropJpeg, never the whole image.
    graph = tf.function(vit_data.decode_and_crop).get_concrete_function(
        tf.TensorSpec([], tf.string), tf.TensorSpec([2], tf.int32)
    ).graph
    branches = {op.type: op for op in graph.get_operations()}
    assert "If" in branches or "StatelessIf" in branches
    ops_per_branch = [{node.op for node in f.node_def} for f in graph.as_graph_def().library.function]
    jpeg_branches = [ops for ops in ops_per_branch if "DecodeAndCropJpeg" in ops]
    assert len(jpeg_branches) == 1 and not jpeg_branches[0] & {"DecodeJpeg", "DecodeImage"}


def write_photos(root, count=8, size=(120, 160)):
    for i in range(count):
        folder = root / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.jpg").write_bytes(tf.io.encode_jpeg(photo(*size, seed=i), quality=90).numpy())
    return root


def test_the_training_pipeline_caches_encoded_bytes_and_augments_every_epoch_anew(tmp_path):
    root = write_photos(tmp_path / "photos", count=8)
    source = vit_data.load_folder(root, test_fraction=0.25)
    ds = vit_data.training_pipeline(source, 32, source.num_train, seed=0, cache=True, shuffle_buffer=100)
    batches = iter(ds)
    first, _ = next(batches)
    # The bytes are kept: with every file gone, the next epochs still read all of them (from the cache)...
    for path in root.glob("*/*.jpg"):
        path.unlink()
    second, labels = next(batches)
    third, _ = next(batches)
    assert second.shape == (source.num_train, 32, 32, 3) and source.skipped.count == 0
    assert sorted(labels.numpy().argmax(-1)) == sorted(first_labels := labels.numpy().argmax(-1))
    assert len(first_labels) == source.num_train
    # ... and crop them anew each epoch.
    assert not np.array_equal(np.sort(first.numpy(), 0), np.sort(second.numpy(), 0))
    assert not np.array_equal(np.sort(second.numpy(), 0), np.sort(third.numpy(), 0))


@pytest.mark.slow  # five training pipelines with RandAugment's graph: 6-9 s on 2 cores
def test_randaugment_in_the_training_pipeline_is_seeded_per_image(tmp_path):
    source = vit_data.load_folder(write_photos(tmp_path / "photos", count=8), test_fraction=0.25)
    calls = []

    def spy(image, seed):  # a RandAugment stand-in that shows the seed each image gets
        calls.append(seed)
        return tf.tensor_scatter_nd_update(image, [[0, 0]], tf.fill([1, 3], tf.cast(seed[0] % 256, tf.uint8)))

    def first(seed, randaugment):
        ds = vit_data.training_pipeline(source, 16, 6, seed=seed, randaugment=randaugment)
        return next(iter(ds))[0].numpy()

    plain, again, other = first(3, (2, 10)), first(3, (2, 10)), first(4, (2, 10))
    np.testing.assert_array_equal(plain, again)
    assert not np.array_equal(plain, other)
    assert not np.array_equal(plain, first(3, None))
    marked = first(3, spy)
    assert calls and len({int(x[0, 0, 0]) for x in marked}) > 1  # each image its own seed


@pytest.fixture()
def data_service():
    """A tf.data service dispatcher and two workers in this process; yields the dispatcher's address."""
    from keras_vit.data import service

    dispatcher = service.start_dispatcher()
    workers = [service.start_worker(dispatcher.target) for _ in range(2)]
    yield dispatcher.target
    for server in (*workers, dispatcher):
        server.stop()


def test_through_tf_data_service_failures_are_named_here_and_workers_draw_their_own_seeds(tmp_path, data_service):
    good, bad = write_odd_folder(tmp_path / "odd")
    source = vit_data.load_folder(tmp_path / "odd")
    tf.random.set_seed(0)  # as the training job does: a global seed must not give every worker the same seeds
    ds = vit_data.training_pipeline(source, (HEIGHT, WIDTH), 4, seed=0, crop=False, data_service=data_service)
    images = np.concatenate([x for x, _ in ds.take(3 * len(good)).as_numpy_iterator()])
    assert images.dtype == np.uint8 and images.shape[1:] == (HEIGHT, WIDTH, 3)
    found = collections.Counter(identify(image, good)[0] for image in images)
    assert set(found) == set(good)
    # Failures on the workers, named and counted in this process, with their errors.
    assert sorted(source.skipped.paths) == sorted(bad) and source.skipped.count == len(bad)
    assert "starting with 49 49 2a 00" in source.skipped.errors[next(p for p in bad if p.endswith("tiff.jpg"))]
    # Each worker draws its own seeds: fixed ones would make both give the same stream, every batch twice.
    batches = [x.tobytes() for x, _ in ds.take(12).as_numpy_iterator()]
    assert len(set(batches)) == len(batches)


def test_through_tf_data_service_a_split_that_fails_entirely_is_an_error(tmp_path, data_service):
    corrupt = ["a/x.png", "b/y.png", "a/z.jpg", "b/w.jpg"]
    source = vit_data.load_folder(write_folder(tmp_path / "bad", ("a", "b"), 0, corrupt=corrupt), test_fraction=0.5)
    ds = vit_data.training_pipeline(source, 8, 1, data_service=data_service)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"All 2 examples of the train split failed"):
        next(iter(ds))


def test_folder_listing_skips_non_utf8_names_empty_class_folders_and_links_into_the_data_set(tmp_path, caplog):
    root = write_folder(tmp_path / "images", classes=("cat", "dog"), per_class=4)
    odd = os.path.join(os.fsencode(root), b"cat", b"caf\xe9.png")  # Latin-1, not UTF-8
    with open(odd, "wb") as f:
        f.write(tf.io.encode_png(np.zeros((8, 8, 3), np.uint8)).numpy())
    (root / "empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("no images")
    os.symlink(root, root / "again")  # a link to the data root
    with caplog.at_level("WARNING"):
        source = vit_data.load_folder(root, test_fraction=0.25)
    assert source.class_names == ["cat", "dog"]
    assert source.num_train + source.num_test == 8  # the UTF-8 files only
    assert source.skipped.count == 1
    [name] = source.skipped.paths
    assert name.endswith("/cat/caf\\xe9.png") and "not UTF-8" in source.skipped.errors[name]
    assert "['again'], links back into the data set" in caplog.text
    assert "['empty', 'notes'], with no file named" in caplog.text
    # What trains: every listed image, in two classes.
    assert sum(1 for _ in source.train) == source.num_train


def test_a_folder_of_one_class_is_an_error_for_a_classifier(tmp_path):
    root = write_folder(tmp_path / "one", classes=("cat",), per_class=4)
    with pytest.raises(ValueError, match=r"One class in .*'cat'.*a classifier needs at least two class subfolders"):
        vit_data.load_folder(root)
