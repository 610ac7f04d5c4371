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
from absl import flags

from experiments import jobs
from keras_vit import visualize


def define_flags():
    """The job's flags, defined when it runs as a program (`jobs.run_job`), not on import."""
    return {
        "model": flags.DEFINE_string("model", None, "A .keras model saved from build_vit.", required=True),
        "image": flags.DEFINE_string("image", None, "An image file.", required=True),
        "out": flags.DEFINE_string("out", None, "Folder for the PNG figures.", required=True),
    }


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


def figures_of_image(model, image_path, out):
    """Writes the figures of `keras_vit.visualize.write_figures` for the image file at `image_path`, resized to
    the model's input, into the folder `out`; returns their paths."""
    height, width, channels = model.input_shape[1:]
    return visualize.write_figures(model, load_image(image_path, height, width, channels), out)


def main(cli):
    for path in figures_of_image(keras.saving.load_model(cli.model.value), cli.image.value, cli.out.value):
        print(f"Wrote {path}")


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
