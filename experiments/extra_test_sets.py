"""The evaluations a job runs after training besides its test split: the extra test sets of config.extra_evals
(ReaL-style multi-label accuracy included)."""


import numpy as np
import tensorflow as tf
from absl import logging

from experiments import datasets
from keras_vit import data as vit_data
from keras_vit import evaluation
from keras_vit.variants import to_pair


def real_accuracy(logits, real_labels):
    """ImageNet ReaL accuracy (Beyer et al. 2020, "Are we done with ImageNet?"): the share of images whose
    top-1 prediction is one of their real labels (`real_labels`: multi-hot rows); images with no real
    label are left out.

    >>> logits = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]])
    >>> real_accuracy(logits, np.array([[0, 1, 1], [0, 1, 0], [0, 0, 0]]))
    0.5
    """
    real_labels = np.asarray(real_labels)
    labelled = real_labels.any(axis=-1)
    if not labelled.any():
        raise ValueError("No image has a real label: ReaL accuracy is undefined.")
    hits = real_labels[np.arange(len(real_labels)), np.argmax(logits, axis=-1)] > 0
    return float(hits[labelled].mean())


def extra_evaluations(config, model, strategy=None):
    """`model` on each test set of config.extra_evals that is prepared in config.data_dir (ImageNet-v2,
    ReaL, ...): {name: {"data", "examples", "accuracy"}}, or {name: {"data", "skipped": why}} (and a log
    line) for a set that is not there.

    Images are evaluated as the job's own test split (`center_crop_resize` at
    config.image_size with config.crop_fraction).  A label that is a
    Sequence of classes (ReaL's "real_label") gives `real_accuracy`, with
    "examples_with_labels" beside it.
    """
    size = to_pair(config.image_size, "image_size")
    results = {}
    for name, spec in config.extra_evals.items():
        data = f"tfds:{spec.dataset}:{spec.split}"
        try:
            images, count, num_classes = vit_data.load_tfds_evaluation(
                spec.dataset, spec.split, data_dir=config.data_dir or None, label_key=spec.get("label", "label"),
                image_limits=datasets.image_limits(config),
            )
            if num_classes != model.output_shape[-1]:
                raise ValueError(f"it has {num_classes} classes, the model {model.output_shape[-1]}.")
        except ValueError as error:
            logging.info("Skipped the extra evaluation %r on %s: %s", name, data, error)
            results[name] = {"data": data, "skipped": str(error)}
            continue
        batches = images.map(
            lambda x, y: (vit_data.center_crop_resize(x, size, config.crop_fraction), y),
            num_parallel_calls=tf.data.AUTOTUNE,
        ).batch(config.batch_size).prefetch(tf.data.AUTOTUNE)
        logits, labels = evaluation.predict_with_labels(model, batches, strategy)
        result = {"data": data, "examples": count, "examples_evaluated": len(labels)}
        if labels.ndim == 2:
            result["accuracy"] = real_accuracy(logits, labels)
            result["examples_with_labels"] = int(labels.any(axis=-1).sum())
        else:
            result["accuracy"] = float(np.mean(np.argmax(logits, axis=-1) == labels))
        logging.info("Extra evaluation %r on %s: %s", name, data, result)
        results[name] = result
    return results
