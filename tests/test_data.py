import numpy as np
import pytest
import tensorflow as tf

from keras_vit import data as vit_data


def write_folder(root, classes=("cat", "dog", "eel"), per_class=6, size=(40, 30), corrupt=()):
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            image = rng.integers(0, 256, (*size, 3)).astype(np.uint8)
            image[..., c % 3] = 255  # a class-dependent colour
            encode = tf.io.encode_png if i % 2 else tf.io.encode_jpeg
            (root / name / f"{i}.{'png' if i % 2 else 'jpg'}").write_bytes(encode(image).numpy())
    for path in corrupt:
        (root / path).write_bytes(b"this is not an image at all")
    return root


def test_folder_with_a_corrupt_file_is_skipped_and_counted(tmp_path):
    root = write_folder(tmp_path / "images", corrupt=["dog/broken.jpg"])
    source = vit_data.load_folder(root, test_fraction=0.25, seed=1)
    assert source.class_names == ["cat", "dog", "eel"] and source.num_classes == 3
    assert source.skipped == [f"{root}/dog/broken.jpg"]
    assert source.num_train + source.num_test == 18
    images = list(source.train.as_numpy_iterator()) + list(source.test.as_numpy_iterator())
    assert len(images) == 18 and all(x.shape == (40, 30, 3) for x, _ in images)
    train = vit_data.image_pipeline(source.train, 16, 4, training=True, num_classes=3)
    batches = list(train)
    assert len(batches) == source.num_train // 4
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
    root = write_folder(tmp_path / "bad", classes=("a", "b"), per_class=0, corrupt=["a/x.png", "b/y.png", "a/z.jpg", "b/w.jpg"])
    with pytest.raises(ValueError, match="No readable images to split.*0 image.*4 skipped"):
        vit_data.load_folder(root)


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


def test_randaugment_mixup_and_evaluation(tmp_path):
    source = vit_data.load_folder(write_folder(tmp_path / "images"), seed=0)
    ds = vit_data.image_pipeline(
        source.train, 16, 4, training=True, num_classes=3, randaugment=(2, 10), mixup_alpha=0.2
    )
    x, y = next(iter(ds))
    assert x.shape == (4, 16, 16, 3) and x.dtype == tf.float32
    np.testing.assert_allclose(tf.reduce_sum(y, -1), 1.0, atol=1e-6)  # mixed one-hot labels
    evaluation = vit_data.image_pipeline(source.test, 16, 5, training=False, num_classes=3)
    assert sum(len(y) for _, y in evaluation) == source.num_test  # every example kept


def test_tfds_by_name_with_data_dir(tmp_path):
    """A TFDS builder over files the test writes, prepared into data_dir, then loaded by name."""
    import tensorflow_datasets as tfds

    root = write_folder(tmp_path / "files", per_class=4)

    class TinyColours(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict(
                    {"image": tfds.features.Image(shape=(None, None, 3)),
                     "label": tfds.features.ClassLabel(names=["cat", "dog", "eel"])}
                ),
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(range(3)), "test": self._generate_examples(range(3, 4))}

        def _generate_examples(self, indices):
            for label, name in enumerate(["cat", "dog", "eel"]):
                for i in indices:
                    path = root / name / f"{i}.{'png' if i % 2 else 'jpg'}"
                    yield f"{name}{i}", {"image": str(path), "label": label}

    TinyColours(data_dir=str(tmp_path / "tfds")).download_and_prepare()
    source = vit_data.load_tfds("tiny_colours", data_dir=str(tmp_path / "tfds"))
    assert source.num_classes == 3 and source.class_names == ["cat", "dog", "eel"]
    assert (source.num_train, source.num_test) == (9, 3)
    ds = vit_data.image_pipeline(source.train, 32, 3, training=True, num_classes=3)
    x, y = next(iter(ds))
    assert x.shape == (3, 32, 32, 3) and y.shape == (3, 3)
    with pytest.raises(ValueError, match="not prepared"):
        vit_data.load_tfds("tiny_colours", data_dir=str(tmp_path / "elsewhere"))
