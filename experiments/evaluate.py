r"""Evaluates a saved or pretrained model on a data set, as a benchmark reports it.

    python -m experiments.evaluate --model=runs/digits/model.keras --dataset=digits --out=runs/digits/eval
    python -m experiments.evaluate --model=google/vit-base-patch16-224 \
        --dataset=tfds:imagenet2012 --split=validation --data_dir=gs://bucket/tfds --out=eval_vit_b16

--model: a .keras file, a SavedModel folder (its signature of images), or anything
`keras_vit.from_pretrained` opens (a hub id, a folder in a hub layout, an .npz).
--dataset: "digits" (the bundled scikit-learn digits, their test split),
"folder:PATH" (an image folder: its test/ subfolder, or the files the training
job holds out with --test_fraction and --seed) or "tfds:NAME" (--split, from
--data_dir).  Images of another size are resized and center-cropped: as the
model's own preprocessing says (a model from `from_pretrained`), else with
--crop_fraction.

Writes into --out: eval.json (top-1, top-5, loss, per-class precision, recall
and F1, expected calibration error, images/s, the split, the number of images
and of skipped files), confusion_matrix.csv, confusion_matrix.png (up to 100
classes) and reliability.png; prints the headline numbers.
"""

import os

import keras
import tensorflow as tf
from absl import flags

from experiments import config_checks, jobs
from keras_vit import data as vit_data
from keras_vit import evaluation


def define_flags():
    """The job's flags, defined when it runs as a program (`jobs.run_job`), not on import."""
    return {
        "model": flags.DEFINE_string("model", None, "A .keras file, a SavedModel, or a from_pretrained name.",
                                     required=True),
        "dataset": flags.DEFINE_string("dataset", "digits", "digits, folder:PATH or tfds:NAME."),
        "split": flags.DEFINE_string("split", "test", "The split evaluated (TFDS: any split string)."),
        "data_dir": flags.DEFINE_string("data_dir", None, "TFDS data directory."),
        "test_fraction": flags.DEFINE_float("test_fraction", 0.2, "A folder without test/: the share held out."),
        "seed": flags.DEFINE_integer("seed", 0, "A folder without test/: the seed of the held-out share."),
        "crop_fraction": flags.DEFINE_float("crop_fraction", 1.0, "Center crop of images of another size."),
        "batch_size": flags.DEFINE_integer("batch_size", 64, "Images per batch."),
        "out": flags.DEFINE_string("out", None, "The folder the results are written to.", required=True),
    }


def is_saved_model(name):
    """Whether `name` is a SavedModel folder (local or gs://)."""
    return tf.io.gfile.isdir(name) and tf.io.gfile.exists(os.path.join(name, "saved_model.pb"))


def load_model(name):
    """A Keras model returning logits from a .keras file, a SavedModel folder or a `from_pretrained` name."""
    if str(name).endswith(".keras"):
        return keras.saving.load_model(name)
    if is_saved_model(name):
        # The signature of uint8 images: `serving_images`, or `serving_default` in SavedModels written before it.
        signatures = tf.saved_model.load(name).signatures
        endpoint = "serving_images" if "serving_images" in signatures else "serving_default"
        spec = signatures[endpoint].structured_input_signature[1].get("images")
        if spec is None:
            raise ValueError(f"{name} has no signature of images (it has {sorted(signatures)}).")
        layer = keras.layers.TFSMLayer(name, call_endpoint=endpoint)
        images = keras.Input(tuple(spec.shape[1:]), dtype=spec.dtype.name, name="images")
        return keras.Model(images, layer(images)["logits"], name=os.path.basename(os.path.normpath(name)))
    from keras_vit import from_pretrained

    return from_pretrained(name)


def image_size(model):
    """The (height, width) of the model's input: its own, or its weights' for a model taking any size."""
    height, width = model.input_shape[1:3]
    if height is None or width is None:
        from keras_vit.export import fixed_image_shape

        return fixed_image_shape(model)[:2]
    return height, width


def evaluation_data(model, dataset, split, *, data_dir=None, test_fraction=0.2, seed=0, crop_fraction=1.0,
                    batch_size=64):
    """(data for `evaluation.evaluate`, class names, what the split is, skipped files) of `dataset`."""
    size = image_size(model)
    if dataset == "digits":
        if split != "test":
            raise ValueError(f"The digits have a test split only here. Received: --split={split!r}")
        digits = vit_data.load_digits(image_size=size[0])
        return (digits.test.images, digits.test.labels), digits.class_names, "the digits' test split", None
    if dataset.startswith("tfds:"):
        images, count, num_classes = vit_data.load_tfds_evaluation(dataset[len("tfds:"):], split, data_dir=data_dir)
        class_names, skipped, what = None, None, f"{dataset}:{split} ({count} examples)"
    else:
        source = vit_data.load_image_source(dataset, test_fraction=test_fraction, seed=seed)
        images, class_names, skipped = source.decoded(split), source.class_names, source.skipped
        what = source.splits.get(split, split)
    preprocessing = getattr(model, "preprocessing", None)

    def prepare(image, label):
        if preprocessing is not None:
            return preprocessing(image), label
        return vit_data.center_crop_resize(image, size, crop_fraction), label

    batches = images.map(prepare, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size).prefetch(2)
    return batches, class_names, what, skipped


def main(cli):
    config_checks.check_dataset_name("--dataset", cli.dataset.value)
    model = load_model(cli.model.value)
    data, class_names, what, skipped = evaluation_data(
        model, cli.dataset.value, cli.split.value, data_dir=cli.data_dir.value, test_fraction=cli.test_fraction.value,
        seed=cli.seed.value, crop_fraction=cli.crop_fraction.value, batch_size=cli.batch_size.value,
    )
    classes = model.output_shape[-1]
    if class_names is not None and len(class_names) != classes:
        raise ValueError(
            f"{cli.model.value} has {classes} classes and {what} has {len(class_names)} "
            f"({', '.join(map(str, class_names[:5]))}{', ...' if len(class_names) > 5 else ''}): evaluate the model "
            "on data of its own classes."
        )
    class_names = class_names or getattr(model, "class_names", None)
    result = evaluation.evaluate(model, data, class_names=class_names, batch_size=cli.batch_size.value)
    result.metrics.update(
        model=str(cli.model.value), dataset=cli.dataset.value, split=str(what),
        skipped_files=0 if skipped is None else skipped.count,
        skipped_examples=[] if skipped is None else skipped.paths[:100],
    )
    paths = result.write(cli.out.value)
    metrics = result.metrics
    print(
        f"{metrics['examples']} images of {what}: top-1 {100 * metrics['top1_accuracy']:.2f}%, top-5 "
        f"{100 * metrics['top5_accuracy']:.2f}%, loss {metrics['loss']:.4f}, ECE "
        f"{metrics['expected_calibration_error']:.4f}, macro F1 {metrics['macro_f1']:.4f}, "
        f"{metrics['images_per_second']:.1f} images/s; skipped files: {metrics['skipped_files']}"
    )
    print("Wrote " + ", ".join(sorted(paths.values())))
    return metrics


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
