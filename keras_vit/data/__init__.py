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

Four modules; `sources` imports `decode`, `pipeline` imports `augment`, and no
other import runs between them:

- `decode`: encoded bytes to uint8 RGB (`decode_image`), and a pass of records
  decoded with the failures skipped and named (`decode_skipping_failures`,
  `DecodeFailures`);
- `sources`: where examples come from: the digits in memory (`load_digits`,
  `Split`, `Dataset`), folders and TFDS sets as an `ImageSource`
  (`load_folder`, `load_tfds`, `load_image_source` for the names
  "folder:PATH" and "tfds:NAME[:SPLIT]"), sharded by file per input pipeline;
- `augment`: one image at a time, in the graph: crops, flips, translation,
  RandAugment, and the evaluation resize and crop;
- `pipeline`: batches for `fit` and `evaluate` (`make_pipeline`,
  `image_pipeline`, `training_pipeline`).

Every name below is importable from `keras_vit.data`.
"""

from keras_vit.requirements import check_tensorflow

# tf.data is TensorFlow's: without a build installed, say which to install before the first import fails.
check_tensorflow("keras_vit.data")

from keras_vit.data.augment import (
    center_crop_resize,
    crop_flip_resize,
    inception_crop,
    make_randaugment,
    random_translate,
)
from keras_vit.data.decode import (
    IMAGE_MAGIC,
    NAMED_IN_A_ROW,
    DecodeFailures,
    decode_image,
    decode_skipping_failures,
)
from keras_vit.data.pipeline import image_pipeline, make_pipeline, training_pipeline
from keras_vit.data.sources import (
    IMAGE_EXTENSIONS,
    Dataset,
    ImageSource,
    Split,
    load_digits,
    load_folder,
    load_image_source,
    load_tfds,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGE_MAGIC",
    "NAMED_IN_A_ROW",
    "Dataset",
    "DecodeFailures",
    "ImageSource",
    "Split",
    "center_crop_resize",
    "crop_flip_resize",
    "decode_image",
    "decode_skipping_failures",
    "image_pipeline",
    "inception_crop",
    "load_digits",
    "load_folder",
    "load_image_source",
    "load_tfds",
    "make_pipeline",
    "make_randaugment",
    "random_translate",
    "training_pipeline",
]
