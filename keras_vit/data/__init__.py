"""Data sets and tf.data input pipelines.

Images stay uint8 in [0, 255] until the model, which rescales them itself
(`build_vit(include_rescaling=True)`), so the same pipeline feeds training,
evaluation and exported models.

The bundled default data set is scikit-learn's digits (1,797 8x8 grey-scale
images of the ten digits, shipped inside the scikit-learn package, so it needs
no download).  Image folders and TFDS sets are read and decoded on the fly
(`load_folder`, `load_tfds`): sharded by file over the input pipelines of a
distributed run, and an image that fails to decode is skipped and named, never
fatal.

Ten modules, and `service` beside them; imports run `decode` -> `header`,
`image_source` -> `decode`, `header`, `digits` -> `image_source`, `folders`
and `tfds` -> `decode`, `header`, `image_source`, `positions`, `augment` ->
`decode`, `header`, `randaugment`, and `pipeline` -> `augment`, `decode`,
`positions`:

- `header`: an encoded image's size read from its header before it is
  decoded and checked against `ImageLimits` (total pixels, aspect ratio), a
  GIF cut after its first frame (`check_image`);
- `decode`: encoded bytes to uint8 RGB (`decode_image`), and records decoded
  with the failures skipped and named (`decode_skipping_failures`, and its
  graph-only parts `mark_failures`, `note_failures`, `carry_failures`;
  `DecodeFailures`);
- `image_source`: what the loaders of encoded images return (`ImageSource`),
  sharded by file per input pipeline (`input_pipelines`), and the check of
  the held-out fractions every loader takes (`check_fraction`);
- `digits`: the bundled digits in memory (`load_digits`, `Split`,
  `Dataset`);
- `folders`: image folders, one subfolder per class (`load_folder`,
  `IMAGE_EXTENSIONS`);
- `tfds`: prepared TFDS sets (`load_tfds`, and `load_tfds_evaluation` for
  extra test sets);
- `randaugment`: RandAugment as published (Cubuk et al. 2019, the TPU
  reference implementation), one op computed per draw (`rand_augment`);
- `augment`: one image at a time, in the graph: crops (a JPEG decoded inside
  its crop: `decode_and_crop`), flips, translation, and the evaluation resize
  and crop;
- `positions`: where a training pipeline is in its passes, saved with a
  backup so that a resumed run reads on from there (`InputPositions`), and
  the orders drawn from a pass's seed (`pass_seed`, `permutation`,
  `seeded_shuffle`);
- `pipeline`: batches for `fit` and `evaluate` (`make_pipeline`,
  `image_pipeline`, `training_pipeline`, `training_stream`);
- `service` (imported as `keras_vit.data.service`): tf.data service, to run
  the training pipeline on other machines' CPUs.

Every name below is importable from `keras_vit.data`, which also picks a
loader by the name a job gives a data set, "folder:PATH" or
"tfds:NAME[:SPLIT]" (`load_image_source`).
"""

from keras_vit.requirements import check_tensorflow

# tf.data is TensorFlow's: without a build installed, say which to install before the first import fails.
check_tensorflow("keras_vit.data")

from keras_vit.data.augment import (
    INCEPTION_AREA_RANGE,
    INCEPTION_ASPECT_RANGE,
    center_crop_resize,
    crop_flip_resize,
    decode_and_crop,
    inception_crop,
    make_randaugment,
    randaugment_function,
    randaugment_seed,
    random_translate,
    resize_and_crop,
    resize_flip,
)
from keras_vit.data.decode import (
    NAMED_IN_A_ROW,
    ONE_PIXEL_PNG,
    DecodeFailures,
    carry_failures,
    decode_checked,
    decode_image,
    decode_skipping_failures,
    error_message,
    load_or_end,
    mark_failures,
    note_failures,
    record_failures,
)
from keras_vit.data.digits import Dataset, Split, load_digits
from keras_vit.data.folders import IMAGE_EXTENSIONS, load_folder
from keras_vit.data.header import (
    EXPECTED_FORMATS,
    FORMATS,
    IMAGE_MAGIC,
    MAX_GIF_STEPS,
    UNNAMED_REFUSAL,
    ImageLimits,
    as_image_limits,
    check_image,
    check_jpeg,
    check_other_formats,
    gif_first_frame,
    image_format,
)
from keras_vit.data.image_source import ImageSource, check_fraction, input_pipelines
from keras_vit.data.pipeline import image_pipeline, make_pipeline, training_pipeline, training_stream
from keras_vit.data.positions import InputPositions, pass_seed, permutation, seeded_shuffle
from keras_vit.data.randaugment import RANDAUGMENT_OPS, apply_op, draw_ops, rand_augment
from keras_vit.data.tfds import load_tfds, load_tfds_evaluation


def load_image_source(
    name, *, data_dir=None, test_split=None, test_fraction=0.2, seed=0, validation_fraction=0.0,
    validation_split=None, image_limits=None,
):
    """The `ImageSource` named "tfds:NAME[:SPLIT]" (`load_tfds`, SPLIT the training split, default
    "train", e.g. "train[:99%]") or "folder:PATH" (`load_folder`); `validation_fraction` and (TFDS)
    `validation_split` say what is held out of the training data for validation; `image_limits` (an
    `ImageLimits`) what images are decoded."""
    kind, _, rest = str(name).partition(":")
    if kind == "tfds" and rest:
        tfds_name, _, split = rest.partition(":")
        return load_tfds(
            tfds_name, data_dir=data_dir, train_split=split or "train", test_split=test_split,
            validation_split=validation_split, validation_fraction=validation_fraction, image_limits=image_limits,
        )
    if kind == "folder" and rest:
        if validation_split:
            raise ValueError(
                f"`validation_split` names a TFDS split; a folder holds out `validation_fraction` of its training "
                f"files, or reads its validation/ subfolder. Received: validation_split={validation_split!r}"
            )
        return load_folder(
            rest, test_fraction=test_fraction, seed=seed, validation_fraction=validation_fraction,
            image_limits=image_limits,
        )
    raise ValueError(f"Unknown image data set {name!r}. Expected 'tfds:NAME[:SPLIT]' or 'folder:PATH'.")


__all__ = [
    "EXPECTED_FORMATS",
    "FORMATS",
    "IMAGE_EXTENSIONS",
    "IMAGE_MAGIC",
    "INCEPTION_AREA_RANGE",
    "INCEPTION_ASPECT_RANGE",
    "MAX_GIF_STEPS",
    "NAMED_IN_A_ROW",
    "ONE_PIXEL_PNG",
    "RANDAUGMENT_OPS",
    "Dataset",
    "DecodeFailures",
    "ImageLimits",
    "ImageSource",
    "InputPositions",
    "Split",
    "apply_op",
    "as_image_limits",
    "carry_failures",
    "center_crop_resize",
    "check_fraction",
    "resize_and_crop",
    "check_image",
    "check_jpeg",
    "check_other_formats",
    "crop_flip_resize",
    "decode_and_crop",
    "decode_checked",
    "decode_image",
    "decode_skipping_failures",
    "error_message",
    "draw_ops",
    "gif_first_frame",
    "image_format",
    "image_pipeline",
    "inception_crop",
    "input_pipelines",
    "load_digits",
    "load_folder",
    "load_image_source",
    "load_or_end",
    "load_tfds",
    "load_tfds_evaluation",
    "make_pipeline",
    "make_randaugment",
    "mark_failures",
    "note_failures",
    "pass_seed",
    "permutation",
    "rand_augment",
    "randaugment_function",
    "randaugment_seed",
    "random_translate",
    "record_failures",
    "resize_flip",
    "seeded_shuffle",
    "training_pipeline",
    "training_stream",
    "UNNAMED_REFUSAL",
]
