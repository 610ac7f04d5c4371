"""An image source by the name a job takes: "tfds:NAME[:SPLIT]" (`keras_vit.data.tfds`) or "folder:PATH"
(`keras_vit.data.folders`); the bundled digits are `keras_vit.data.digits`."""

from keras_vit.data.folders import load_folder
from keras_vit.data.tfds import load_tfds


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
