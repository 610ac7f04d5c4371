"""The bundled digits: scikit-learn's 1,797 8x8 grey-scale images of the ten digits, held in memory.

They ship inside the scikit-learn package, so they need no download.  `load_digits` gives a `Dataset` of
`Split`s (uint8 images and int32 labels).
"""

import dataclasses

import numpy as np
import tensorflow as tf

from keras_vit.data.image_source import check_fraction


@dataclasses.dataclass
class Split:
    """An in-memory split: uint8 images (N, H, W, C) and int32 labels (N,)."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self):
        return len(self.labels)


@dataclasses.dataclass
class Dataset:
    """In-memory splits: `validation` (None when none was held out) is taken from the training data."""

    train: Split
    test: Split
    num_classes: int
    class_names: list
    validation: Split | None = None


def load_digits(image_size=8, test_fraction=0.2, seed=0, validation_fraction=0.0):
    """scikit-learn's digits as RGB uint8 images, split into train, test and (optionally) validation.

    The 8x8 images (values 0..16) are scaled to 0..255, resized to
    `image_size` with bilinear interpolation if it is not 8, and repeated over
    three channels so the model sees the RGB input every ViT checkpoint and
    exported model expects.  The test split is stratified by class and
    seeded; with `validation_fraction`, that share of the remaining training
    images is held out as `validation` (stratified, seeded), and `train` is
    the rest.  The test split does not depend on `validation_fraction`.
    """
    # Imported here: scikit-learn is needed for this data set only.
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    check_fraction("test_fraction", test_fraction)
    check_fraction("validation_fraction", validation_fraction, zero=True)
    digits = sklearn_digits()
    images = digits.images.astype(np.float32) * (255.0 / 16.0)
    if image_size != 8:
        images = tf.image.resize(images[..., None], (image_size, image_size)).numpy()[..., 0]
    images = np.clip(np.round(images), 0, 255).astype(np.uint8)
    images = np.repeat(images[..., None], 3, axis=-1)
    labels = digits.target.astype(np.int32)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    validation = None
    if validation_fraction:
        train_x, val_x, train_y, val_y = train_test_split(
            train_x, train_y, test_size=validation_fraction, random_state=seed, stratify=train_y
        )
        validation = Split(val_x, val_y)
    return Dataset(
        train=Split(train_x, train_y),
        test=Split(test_x, test_y),
        num_classes=10,
        class_names=[str(i) for i in range(10)],
        validation=validation,
    )
