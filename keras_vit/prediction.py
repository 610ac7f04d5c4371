"""Predictions for image files, streamed: a folder, a glob or a `gs://` prefix, in batches, bad files named.

`predict_files(model, paths)` yields one `Prediction` per file, in the order of `paths`: its top-k classes
with their names and probabilities, or the reason it could not be read or decoded.  Files are read and
decoded by a tf.data pipeline (in parallel, ahead of the model), so memory holds a few batches whatever the
number of files; a file that fails is left out of its batch and named, and the others go on.

The model is a Keras model taking raw pixels (its own `preprocessing`, else a center crop of
`crop_fraction`, prepares each image: `image_decoder`, the same function as the SavedModel's
`serving_bytes`), or a SavedModel written by `keras_vit.export.export_saved_model`, whose `serving_bytes`
signature prepares the images as it does when served.
"""

import dataclasses
import os
import weakref

import numpy as np

from keras_vit.data import center_crop_resize, decode_image, resize_and_crop
from keras_vit.data.decode import error_message
from keras_vit.data.header import as_image_limits
from keras_vit.requirements import import_tensorflow

tf = import_tensorflow("keras_vit.prediction")

# The class names of a SavedModel, one per line, in its assets/ folder (export_saved_model writes it).
LABELS_FILE = "labels.txt"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One file's prediction: its top classes (`classes`, `names`, `probabilities`, most probable first), or
    `error`, why it was skipped (then the three are empty)."""

    path: str
    classes: tuple = ()
    names: tuple = ()
    probabilities: tuple = ()
    error: str = None


def image_decoder(limits, channels, preprocessing, size, crop_fraction, *, messages=True):
    """Encoded bytes -> the uint8 (height, width, channels) image a model takes: decoded within `limits`
    (refused past them), grey-scale for a one-channel model, resized and cropped by `preprocessing` (a
    `keras_vit.Preprocessing`) or else a center crop of `crop_fraction` (None: 1.0) to `size`.

    The SavedModel's `serving_bytes` and `predict_files` map it over their images.  `messages=False`: a
    refusal's error is not spelled out in the graph (`keras_vit.data.check_image`), for input pipelines that
    ask again eagerly for the reason."""

    def decode(encoded):
        image = decode_image(encoded, limits, messages=messages)
        if channels == 1:
            image = tf.cast(tf.round(tf.image.rgb_to_grayscale(tf.cast(image, tf.float32))), tf.uint8)
        if preprocessing is not None:
            return resize_and_crop(image, preprocessing)
        return center_crop_resize(image, size, 1.0 if crop_fraction is None else crop_fraction)

    return decode


# === What a model takes ===


def fixed_image_shape(model):
    """The (height, width, channels) a model takes; for one that takes any size (`dynamic_image_size`), the size
    its weights were made for."""
    shape = tuple(model.input_shape[1:])
    if len(shape) == 3 and None in shape[:2] and shape[2] is not None:
        size = _base_size(model)
        if size is not None:
            return (*size, shape[2])
    if len(shape) != 3 or None in shape:
        raise ValueError(f"Expected a model with a static (height, width, channels) input. Received: {shape}")
    return shape


def _base_size(model):
    """The image size the weights of a model from `build_vit(dynamic_image_size=True)` were made for."""
    preprocessing = getattr(model, "preprocessing", None)
    if preprocessing is not None:
        return preprocessing.image_size
    encoders = [layer for layer in model.layers if getattr(layer, "base_image_size", None) is not None]
    hybrid = any(layer.name == "resnet" for layer in model.layers)
    return encoders[0].base_image_size if len(encoders) == 1 and not hybrid else None


def is_dynamic(model):
    """Whether a model takes images of any height and width (`dynamic_image_size`)."""
    return None in tuple(model.input_shape[1:3])


def model_preprocessing(model, preprocessing, crop_fraction):
    """The `Preprocessing` that prepares encoded images for the model (None: a center crop of `crop_fraction`):
    `preprocessing`, else the model's own unless `crop_fraction` is given; its crop checked against the model's
    fixed size."""
    if preprocessing is not None and crop_fraction is not None:
        raise ValueError("Pass `crop_fraction` or `preprocessing`, not both.")
    if preprocessing is None and crop_fraction is None:
        preprocessing = getattr(model, "preprocessing", None)
    if preprocessing is not None:
        height, width = preprocessing.image_size
        if not is_dynamic(model) and (height, width) != fixed_image_shape(model)[:2]:
            raise ValueError(
                f"The preprocessing crops {preprocessing.image_size}, the model takes {fixed_image_shape(model)[:2]}."
            )
    return preprocessing


# === Which files ===


def _hidden(name):
    return name.startswith(".")


def _walk_local(folder, seen=None):
    """The files under `folder`, depth first, each folder's entries sorted by name; a folder reached again
    through a link is not walked twice."""
    seen = set() if seen is None else seen
    real = os.path.realpath(folder)
    if real in seen:
        return
    seen.add(real)
    with os.scandir(folder) as entries:
        found = sorted((entry.name, entry.is_dir()) for entry in entries if not _hidden(entry.name))
    for name, is_folder in found:
        path = os.path.join(folder, name)
        if is_folder:
            yield from _walk_local(path, seen)
        else:
            yield path


def _is_remote_folder(path):
    """Whether a path listed by `tf.io.gfile` is a folder: Cloud Storage lists one with a trailing slash (and
    asking it per object would cost a request each); other file systems are asked."""
    return path.endswith("/") or (not path.startswith("gs://") and tf.io.gfile.isdir(path))


def _walk_remote(folder):
    for name in sorted(tf.io.gfile.listdir(folder)):
        if _hidden(name):
            continue
        path = f"{folder.rstrip('/')}/{name}"
        if _is_remote_folder(path):
            yield from _walk_remote(path.rstrip("/"))
        else:
            yield path


def list_files(location):
    """The files `location` names, streamed in a fixed order: a folder (local or `gs://`: every file under it,
    depth first with each folder's entries sorted by name, names starting with "." left out), a glob
    (`tf.io.gfile.glob`; a folder it matches is walked), or one file.  Raises FileNotFoundError naming
    `location` when it is none of them or matches nothing."""
    location = os.fspath(location)
    remote = "://" in location
    if any(character in location for character in "*?["):
        matches = sorted(tf.io.gfile.glob(location))
        if not matches:
            raise FileNotFoundError(f"No file matches {location!r}.")
        return _matched(matches, remote)
    if tf.io.gfile.isdir(location):
        return _walk_remote(location) if remote else _walk_local(location)
    if tf.io.gfile.exists(location):
        return iter([location])
    raise FileNotFoundError(f"{location!r} is no folder, file or glob that matches a file.")


def _matched(matches, remote):
    for path in matches:
        if remote and _is_remote_folder(path):
            yield from _walk_remote(path.rstrip("/"))
        elif not remote and os.path.isdir(path):
            yield from _walk_local(path)
        else:
            yield path


def shown(path):
    """`path` as text that can be written anywhere: a local name that is not UTF-8 with its bytes escaped."""
    path = os.fspath(path)
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def skip_done(paths, done):
    """`paths` without those in `done` (a set of `shown` paths): the files a resumed run still has to do."""
    return (path for path in paths if shown(path) not in done)


# === The model ===


class _KerasRunner:
    """A Keras model: images decoded and prepared in the input pipeline, batches through the model."""

    def __init__(self, model, crop_fraction, limits):
        height, width, channels = fixed_image_shape(model)
        preprocessing = model_preprocessing(model, None, crop_fraction)
        self.class_names = getattr(model, "class_names", None)
        self.num_classes = model.output_shape[-1]
        self.prepare = image_decoder(limits, channels, preprocessing, (height, width), crop_fraction, messages=False)
        self.explain = image_decoder(limits, channels, preprocessing, (height, width), crop_fraction)
        self._model = model

    def __call__(self, images):
        return _probabilities(self._model)(images).numpy()


# One traced function per model, whichever run asks (a new one per call would trace again each time).
_TRACED = weakref.WeakKeyDictionary()


def _probabilities(model):
    if model not in _TRACED:
        # By a weak reference: the function, a value of the dictionary, must not keep its key alive.
        reference = weakref.ref(model)

        def probabilities(images):
            logits = reference()(tf.cast(images, tf.float32), training=False)
            return tf.nn.softmax(tf.cast(logits, tf.float32))

        _TRACED[model] = tf.function(probabilities, reduce_retracing=True)
    return _TRACED[model]


@dataclasses.dataclass(frozen=True)
class SavedModel:
    """A SavedModel folder from `export_saved_model`, loaded (`load_saved_model`): `predict_files` takes it in
    place of the folder's path, so that several runs load it once."""

    folder: str
    loaded: object  # tf.saved_model.load's; its signatures need it alive
    num_classes: int
    class_names: list = None

    @property
    def signature(self):
        return self.loaded.signatures["serving_bytes"]


def load_saved_model(folder):
    """The SavedModel in `folder` (local or `gs://`), loaded once for `predict_files`; a ValueError if it has no
    `serving_bytes` signature."""
    folder = os.fspath(folder)
    loaded = tf.saved_model.load(folder)
    signature = loaded.signatures.get("serving_bytes")
    if signature is None:
        raise ValueError(
            f"{folder} has no `serving_bytes` signature (it has {sorted(loaded.signatures)}): predictions "
            "need the SavedModel that keras_vit.export.export_saved_model writes."
        )
    num_classes = int(signature.structured_outputs["probabilities"].shape[-1])
    return SavedModel(folder, loaded, num_classes, read_labels(folder))


class _SavedModelRunner:
    """A loaded `SavedModel`: each file checked in the input pipeline (read and decoded within `limits`), its
    bytes through `serving_bytes`."""

    def __init__(self, saved, limits):
        self._signature = saved.signature
        self.num_classes = saved.num_classes
        self.class_names = saved.class_names

        def check(encoded):
            with tf.control_dependencies([decode_image(encoded, limits, messages=False)]):
                return tf.identity(encoded)

        self.prepare = check
        self.explain = lambda encoded: decode_image(encoded, limits)

    def __call__(self, encoded):
        return self._signature(encoded=encoded)["probabilities"].numpy()


def read_labels(folder):
    """The class names a SavedModel keeps in assets/labels.txt, or None."""
    path = f"{os.fspath(folder).rstrip('/')}/assets/{LABELS_FILE}"
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path) as f:
        return f.read().split("\n")[:-1]


def _runner(model, crop_fraction, limits):
    if isinstance(model, (str, os.PathLike)):
        model = load_saved_model(model)
    if isinstance(model, SavedModel):
        return _SavedModelRunner(model, limits)
    if not hasattr(model, "output_shape"):
        raise TypeError(
            "Expected a Keras model, the path of a SavedModel folder or a `load_saved_model`. Received: "
            f"{type(model).__name__}"
        )
    return _KerasRunner(model, crop_fraction, limits)


# === The stream ===


def _reason(path, explain):
    """Why `path` failed in the pipeline: its read's or its decode's error, asked again eagerly."""
    try:
        explain(tf.io.read_file(path))
    except tf.errors.OpError as error:
        return error_message(error)
    return "failed in the input pipeline, read when tried again (a transient read error?)"


class Predictions:
    """What `predict_files` returns: iterating it yields a `Prediction` per file, in order (once); `top_k` and
    `class_names` are what each prediction holds."""

    def __init__(self, stream, top_k, class_names):
        self._stream, self.top_k, self.class_names = stream, top_k, class_names

    def __iter__(self):
        return self._stream

    def __next__(self):
        return next(self._stream)

    def close(self):
        """Stops the stream (its input pipeline with it) before its end."""
        self._stream.close()


def predict_files(model, paths, *, top_k=None, batch_size=64, crop_fraction=None, image_limits=None):
    """A `Prediction` for each of `paths` (any iterable of file paths, local or `gs://`), in order, as
    `Predictions` to iterate.

    Args:
        model: a Keras model taking raw pixels and returning logits (a `keras_vit.ViT`, a `.keras` file
            loaded, `from_pretrained`'s), or the path of a SavedModel folder from `export_saved_model` (or
            the folder loaded once by `load_saved_model`).
        paths: the files (`list_files` streams those of a folder, a glob or a prefix).
        top_k: how many of the most probable classes each prediction names (None: 5, or every class if there
            are fewer).
        batch_size: images per batch through the model.
        crop_fraction: for a Keras model without its own `preprocessing`: the central fraction of the
            shorter side kept (None: 1.0).  A SavedModel prepares images as it was exported to.
        image_limits: the largest image decoded (`keras_vit.data.ImageLimits`; None: its defaults); a
            file past them is skipped with the reason.

    A file that cannot be read, is not an image (JPEG, PNG, GIF, BMP or WebP) or is past the limits gives a
    `Prediction` with `error` set; names are the model's `class_names` (a SavedModel's labels), else the
    class indices as text.  Memory holds the batches in flight only.
    """
    limits = as_image_limits(image_limits)
    runner = _runner(model, crop_fraction, limits)
    top_k = min(5, runner.num_classes) if top_k is None else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= runner.num_classes:
        raise ValueError(f"`top_k` must be an integer in [1, {runner.num_classes}]. Received: top_k={top_k!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    names = runner.class_names or [str(index) for index in range(runner.num_classes)]
    if len(names) != runner.num_classes:
        raise ValueError(f"The model has {runner.num_classes} classes and {len(names)} class names.")
    return Predictions(_stream(runner, paths, names, top_k, batch_size), top_k, tuple(names))


def _stream(runner, paths, names, top_k, batch_size):
    # The paths the pipeline has taken but whose batch has not come out yet; a failed file never comes out.
    in_flight = {}
    # Files refused before the pipeline, by index: why.
    refused = {}

    def generate():
        for index, path in enumerate(paths):
            in_flight[index] = shown(path)
            if in_flight[index] != os.fspath(path):
                refused[index] = "its name is not UTF-8: rename it to read it"
                continue
            yield index, in_flight[index]

    files = tf.data.Dataset.from_generator(
        generate, output_signature=(tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.string))
    )
    batches = (
        files.map(lambda index, path: (index, runner.prepare(tf.io.read_file(path))),
                  num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        .ignore_errors()
        .batch(batch_size)
        .prefetch(1)
    )  # fmt: skip

    def failed(index):
        path = in_flight.pop(index)
        return Prediction(path, error=refused.pop(index, None) or _reason(path, runner.explain))

    def predicted(index, row):
        best = np.argsort(-row, kind="stable")[:top_k]
        return Prediction(
            in_flight.pop(index), tuple(int(c) for c in best), tuple(names[c] for c in best),
            tuple(float(row[c]) for c in best),
        )  # fmt: skip

    next_index = 0
    for indices, inputs in batches:
        for index, result in _run_batch(runner, indices.numpy(), inputs):
            while next_index < index:
                yield failed(next_index)
                next_index += 1
            yield predicted(index, result) if isinstance(result, np.ndarray) else Prediction(
                in_flight.pop(index), error=result
            )
            next_index = index + 1
    for index in sorted(in_flight):
        yield failed(index)


def _run_batch(runner, indices, inputs):
    """(index, probabilities or the error's message) for each element of a batch: the batch at once, or, if it
    fails (a SavedModel's own limits refusing an image), each element alone."""
    try:
        return list(zip(indices, runner(inputs)))
    except tf.errors.InvalidArgumentError:
        pass
    results = []
    for position, index in enumerate(indices):
        try:
            results.append((index, runner(inputs[position : position + 1])[0]))
        except tf.errors.InvalidArgumentError as error:
            results.append((index, error_message(error)))
    return results

