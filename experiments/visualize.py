r"""Writes the figures of what a trained ViT learned, for one image.

    python -m experiments.visualize --model=runs/digits/model.keras \
        --image=path/to/image.png --out=runs/digits/figures

The image (PNG, JPEG, BMP or GIF; local or gs://) is resized to the model's
input size.  Writes `patch_grid.png` (the image as the sequence of patches
the encoder reads), `attention_rollout.png`, `head_attention.png`,
`mean_attention_distance.png`, `position_similarity.png` and (not for
hybrids) `embedding_filters.png` into --out.
"""

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

from keras_vit import visualize

_MODEL = flags.DEFINE_string("model", None, "A .keras model saved from build_vit.", required=True)
_IMAGE = flags.DEFINE_string("image", None, "An image file.", required=True)
_OUT = flags.DEFINE_string("out", None, "Folder for the PNG figures.", required=True)


def load_image(path, height, width, channels):
    """Decodes an image file and resizes it to (height, width); uint8 pixels."""
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"No image at {path!r}.")
    data = tf.io.gfile.GFile(path, "rb").read()
    try:
        image = tf.io.decode_image(data, channels=channels, expand_animations=False)
    except tf.errors.InvalidArgumentError as error:
        raise ValueError(
            f"{path!r} is not an image TensorFlow can decode (PNG, JPEG, BMP, GIF): {error.message}"
        ) from None
    image = tf.image.resize(image, (height, width), antialias=True)
    return np.clip(np.round(image.numpy()), 0, 255).astype(np.uint8)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    model = keras.saving.load_model(_MODEL.value)
    height, width, channels = model.input_shape[1:]
    image = load_image(_IMAGE.value, height, width, channels)
    for path in visualize.write_figures(model, image, _OUT.value):
        print(f"Wrote {path}")


if __name__ == "__main__":
    app.run(main)
