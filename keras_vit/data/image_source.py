"""What the loaders of encoded images return (`ImageSource`), and the checks and sharding they share.

An `ImageSource` reads a split's records (a reference, a label and a name for each image) and decodes them
with `keras_vit.data.decode`, one input pipeline (one host) at a time; `load_folder` and `load_tfds` make
one each.

Model selection never looks at the test split: every loader can hold out a validation split taken from the
training data (`validation_fraction`, stratified by class for the digits and folders; for TFDS a slice of the
training split, as big_vision's `train[:99%]` / `train[99%:]`), and the training split is then what is left.
"""

import dataclasses
from collections.abc import Callable

import tensorflow as tf

from keras_vit.data.decode import DecodeFailures, decode_skipping_failures
from keras_vit.data.header import ImageLimits


def check_fraction(name, value, *, zero=False):
    """Raises a ValueError unless `value` (the argument `name`) is in (0, 1), or [0, 1) with `zero`."""
    low_ok = value >= 0.0 if zero else value > 0.0
    if not (low_ok and value < 1.0):
        interval = "[0, 1)" if zero else "(0, 1)"
        raise ValueError(f"`{name}` must be in {interval}. Received: {name}={value!r}")


@dataclasses.dataclass
class ImageSource:
    """Images decoded on the fly: tf.data of (uint8 (H, W, 3) of any size, int32 label).

    `decoded("train" | "validation" | "test", input_context=..., shuffle=..., seed=...)`
    is the data of one input pipeline (one host): with a
    `tf.distribute.InputContext` of several pipelines each reads and decodes
    its own files only.  `train`, `validation` and `test` are all of a split,
    in order.  The validation split (`num_validation` examples; 0 when none
    was held out) is taken from the training data, and the training split is
    what is left of it.  `splits` says what each split is, in words (a TFDS
    split string such as "train[:99%]", or which files of a folder).  Images
    that fail to read or decode are skipped and named in `skipped`, and so
    are those past `image_limits` (refused before decoding, from the size
    their header declares).
    """

    num_classes: int
    class_names: list
    num_train: int
    num_test: int
    # (split, input_context, shuffle, seed, shuffle_buffer) -> (tf.data of (reference, label, name),
    # the number of records this pipeline reads per pass).
    read: Callable[..., tuple]
    load: Callable[[tf.Tensor], tf.Tensor]  # reference -> encoded bytes, in the graph
    reload: Callable[[str], tf.Tensor]  # name -> encoded bytes, eagerly (for error messages)
    skipped: DecodeFailures = dataclasses.field(default_factory=DecodeFailures)
    num_validation: int = 0
    splits: dict = dataclasses.field(default_factory=dict)  # split -> what it is, in words
    image_limits: ImageLimits = dataclasses.field(default_factory=ImageLimits)
    # (split, input_context, order_seed, shuffle_buffer) -> tf.data of (reference, label, name): one pass of
    # what `read` gives, in an order drawn from order_seed (a scalar int64 tensor) alone, for the training
    # pipeline's passes; None: `read`'s order shuffled in a buffer of shuffle_buffer.
    read_pass: Callable[..., tf.data.Dataset] | None = None

    def decoded(self, split, *, input_context=None, shuffle=False, seed=0, shuffle_buffer=10_000):
        """The decoded (image, label) pairs of `split` ("train", "validation" or "test") for one input pipeline.

        shuffle: a new order each pass, from `seed` (files, then records for
        TFDS within `shuffle_buffer`; a folder's list of names is shuffled
        whole).  Without it, the split's order.
        """
        self.check_split(split)
        records, total = self.read(split, input_context, shuffle, seed, shuffle_buffer)
        what = f"the {split} split"
        if input_context is not None and input_context.num_input_pipelines > 1:
            what += f" read by input pipeline {input_context.input_pipeline_id} of {input_context.num_input_pipelines}"
        if total < 1:
            raise ValueError(f"No examples in {what}.")
        return decode_skipping_failures(records, self.load, self.skipped, what, self.reload, self.image_limits)

    def check_split(self, split):
        """Raises a ValueError unless this source has `split` ("validation" only when one was held out)."""
        if split in ("train", "test") or (split == "validation" and self.num_validation):
            return
        expected = "'train', 'validation' or 'test'" if self.num_validation else "'train' or 'test'"
        message = f"`split` must be {expected}. Received: split={split!r}"
        if split == "validation":
            message += (
                ". No validation split was held out of the training data: load the data set with "
                "validation_fraction > 0 (or, for TFDS, a validation_split)."
            )
        raise ValueError(message)

    @property
    def train(self):
        return self.decoded("train")

    @property
    def validation(self):
        return self.decoded("validation")

    @property
    def test(self):
        return self.decoded("test")


def input_pipelines(input_context):
    """(number of input pipelines, this one's index)."""
    if input_context is None:
        return 1, 0
    return input_context.num_input_pipelines, input_context.input_pipeline_id

