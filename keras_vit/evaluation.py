"""Evaluation as a benchmark reports it: `evaluate(model, data)` and the report of a set of predictions.

`classification_report(logits, labels)` computes, from the logits and the integer labels of a data set:

- top-1 and top-k accuracy and the mean cross-entropy (Keras' `SparseCategoricalAccuracy`,
  `SparseTopKCategoricalAccuracy`, `SparseCategoricalCrossentropy`);
- per class: precision, recall, F1 (Keras' `F1Score`) and support, read from the confusion matrix (rows: the
  true class, columns: the predicted one, as scikit-learn's), and their macro averages;
- the expected calibration error (Guo et al. 2017, "On Calibration of Modern Neural Networks"): the
  predictions grouped by their top probability into `num_bins` equal bins, ECE = sum over bins of
  (count / N) x |accuracy - mean confidence|, and the bins themselves for a reliability diagram.

`evaluate(model, data)` predicts a data set (a `tf.data.Dataset` of (images, labels) batches, or a pair of
arrays) under a strategy or `keras.distribution` if one is given, times it, and returns an `Evaluation`;
`Evaluation.write(folder)` writes `eval.json`, `confusion_matrix.csv`, `confusion_matrix.png` (up to
`MAX_MATRIX_CLASSES` classes) and `reliability.png`.
"""

import contextlib
import dataclasses
import json
import logging
import time

import keras
import numpy as np

from keras_vit.layers.common import check_positive_int

# The most classes drawn in a confusion matrix's picture (its CSV has them all).
MAX_MATRIX_CLASSES = 100


def _keras_metric(metric, labels, values):
    metric.update_state(labels, values)
    return float(keras.ops.convert_to_numpy(metric.result()))


def expected_calibration_error(probabilities, labels, num_bins=15):
    """(ECE, bins) of predictions: `bins` is a list of {lower, upper, count, confidence, accuracy} for each of
    `num_bins` equal bins of the top probability in [0, 1] (the last bin closed), empty bins with count 0."""
    probabilities, labels = np.asarray(probabilities, np.float64), np.asarray(labels)
    confidence = probabilities.max(axis=-1)
    correct = probabilities.argmax(axis=-1) == labels
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    index = np.clip(np.searchsorted(edges, confidence, side="right") - 1, 0, num_bins - 1)
    bins, ece = [], 0.0
    for b in range(num_bins):
        members = index == b
        count = int(members.sum())
        mean_confidence = float(confidence[members].mean()) if count else 0.0
        accuracy = float(correct[members].mean()) if count else 0.0
        ece += count / len(labels) * abs(accuracy - mean_confidence)
        bins.append({"lower": float(edges[b]), "upper": float(edges[b + 1]), "count": count,
                     "confidence": mean_confidence, "accuracy": accuracy})
    return float(ece), bins


def confusion_matrix(labels, predictions, num_classes):
    """int64 (num_classes, num_classes) counts: rows the true class, columns the predicted one (scikit-learn's
    layout)."""
    confusion = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(confusion, (np.asarray(labels), np.asarray(predictions)), 1)
    return confusion


@keras.saving.register_keras_serializable(package="keras_vit")
class ConfusionAccuracy(keras.metrics.Metric):
    """Top-1 accuracy (Keras' `CategoricalAccuracy` for one-hot or soft labels, `SparseCategoricalAccuracy` for
    integer ones) kept as the confusion matrix of the examples since the last reset, weighted by
    `sample_weight`: the accuracy is its trace over its sum.

    After `fit`'s validation of an epoch, `confusion()` is that split's matrix (rows the true class, columns the
    predicted one), so `keras_vit.callbacks.TensorBoardFigures` draws it without predicting the split again.
    The counts are float32, exact up to 2**24 examples in a cell.

    Args:
        num_classes: the classes (the model's logits).
        name: the metric's name in the logs.
    """

    def __init__(self, num_classes, name="accuracy", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.num_classes = check_positive_int("num_classes", num_classes)
        self._direction = "up"  # What Keras' callbacks read in mode "auto": higher is better, as for accuracy.
        self.counts = self.add_variable(shape=(num_classes, num_classes), initializer="zeros", dtype="float32",
                                        name="counts")  # fmt: skip

    def update_state(self, y_true, y_pred, sample_weight=None):
        ops = keras.ops
        y_pred = ops.convert_to_tensor(y_pred)
        y_true = ops.convert_to_tensor(y_true)
        if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] != 1:
            y_true = ops.argmax(y_true, axis=-1)  # One-hot or soft (mixed) labels.
        classes = self.num_classes
        true = ops.reshape(ops.cast(y_true, "int32"), (-1,))
        predicted = ops.cast(ops.argmax(ops.reshape(y_pred, (-1, classes)), axis=-1), "int32")
        weights = ops.ones_like(true, "float32") if sample_weight is None else (
            ops.reshape(ops.cast(sample_weight, "float32"), (-1,)))  # fmt: skip
        # Each example adds its weight to its (true, predicted) cell: a scatter of the batch, no num_classes^2 work.
        cells = ops.segment_sum(weights, true * classes + predicted, num_segments=classes * classes)
        self.counts.assign_add(ops.reshape(cells, (classes, classes)))

    def result(self):
        total = keras.ops.sum(self.counts)
        return keras.ops.divide_no_nan(keras.ops.trace(self.counts), total)

    def confusion(self):
        """The counted confusion matrix, int64 (num_classes, num_classes)."""
        return np.rint(keras.ops.convert_to_numpy(self.counts)).astype(np.int64)

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}


def row_rates(confusion):
    """The confusion matrix with each row divided by its class's count (0 for a class with none): the recall on
    the diagonal."""
    confusion = np.asarray(confusion, np.float64)
    support = confusion.sum(axis=1, keepdims=True)
    return np.divide(confusion, support, out=np.zeros_like(confusion), where=support > 0)


def classification_report(logits, labels, *, class_names=None, top_k=5, num_bins=15):
    """The metrics of logits (N, classes) against integer labels (N,); see the module's docstring.

    Returns a dict: `examples`, `top1_accuracy`, `top{top_k}_accuracy`,
    `loss`, `expected_calibration_error`,
    `macro_precision`, `macro_recall`, `macro_f1`, `per_class` ({name:
    {precision, recall, f1, support}}), `calibration_bins`, and
    `confusion_matrix` (a list of rows).
    """
    logits = np.asarray(logits, np.float32)
    labels = np.asarray(labels).astype(np.int64).reshape(-1)
    if logits.ndim != 2 or len(logits) != len(labels) or len(labels) == 0:
        raise ValueError(
            f"Expected logits (N, classes) and N integer labels, N > 0. Received: logits of shape {logits.shape}, "
            f"labels of shape {labels.shape}"
        )
    num_classes = logits.shape[1]
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"Labels must be in [0, {num_classes}). Received: labels in [{labels.min()}, {labels.max()}]")
    names = [str(n) for n in class_names] if class_names is not None else [str(i) for i in range(num_classes)]
    if len(names) != num_classes:
        raise ValueError(f"{len(names)} class names for {num_classes} classes.")
    k = min(top_k, num_classes)
    probabilities = keras.ops.convert_to_numpy(keras.ops.softmax(logits, axis=-1)).astype(np.float64)
    confusion = confusion_matrix(labels, logits.argmax(axis=-1), num_classes)
    true_positives = np.diag(confusion).astype(np.float64)
    predicted, support = confusion.sum(axis=0), confusion.sum(axis=1)
    # 0 where nothing was predicted (or present), as scikit-learn's zero_division=0.
    precision = np.divide(true_positives, predicted, out=np.zeros(num_classes), where=predicted > 0)
    recall = np.divide(true_positives, support, out=np.zeros(num_classes), where=support > 0)
    f1_score = keras.metrics.F1Score(average=None, threshold=None)
    f1_score.update_state(np.eye(num_classes, dtype=np.float32)[labels], probabilities.astype(np.float32))
    f1 = keras.ops.convert_to_numpy(f1_score.result()).astype(np.float64)
    ece, bins = expected_calibration_error(probabilities, labels, num_bins)
    return {
        "examples": int(len(labels)),
        "top1_accuracy": _keras_metric(keras.metrics.SparseCategoricalAccuracy(), labels, logits),
        # With fewer classes than k, every label is among the top k.
        f"top{top_k}_accuracy": _keras_metric(keras.metrics.SparseTopKCategoricalAccuracy(k=k), labels, logits),
        "loss": _keras_metric(keras.metrics.SparseCategoricalCrossentropy(from_logits=True), labels, logits),
        "expected_calibration_error": ece,
        "macro_precision": float(precision.mean()),
        "macro_recall": float(recall.mean()),
        "macro_f1": float(f1.mean()),
        "per_class": {
            name: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
            for name, p, r, f, s in zip(names, precision, recall, f1, support)
        },
        "calibration_bins": bins,
        "confusion_matrix": confusion.tolist(),
    }


@dataclasses.dataclass
class Evaluation:
    """What `evaluate` measured: `metrics` (`classification_report`'s, with `images_per_second` and what the
    caller adds: the split, skipped files), `class_names`, and the logits and labels themselves."""

    metrics: dict
    class_names: list
    logits: np.ndarray
    labels: np.ndarray

    def write(self, folder, *, figures=True):
        """Writes `eval.json` (the metrics), `confusion_matrix.csv` and, with `figures`, `reliability.png` and
        `confusion_matrix.png` (up to `MAX_MATRIX_CLASSES` classes) into `folder` (local or gs://); each file
        whole or not at all.  Returns {name: path}."""
        import tensorflow as tf

        from keras_vit.files import write_text_atomically

        folder = str(folder)
        tf.io.gfile.makedirs(folder)
        paths = {"eval.json": tf.io.gfile.join(folder, "eval.json"),
                 "confusion_matrix.csv": tf.io.gfile.join(folder, "confusion_matrix.csv")}
        write_text_atomically(paths["eval.json"], json.dumps(self.metrics, indent=2) + "\n")
        write_text_atomically(paths["confusion_matrix.csv"], confusion_csv(self.metrics["confusion_matrix"],
                                                                           self.class_names))
        if figures:
            from keras_vit.visualize.figures import save_figure

            paths["reliability.png"] = save_figure(
                reliability_diagram(self.metrics["calibration_bins"], self.metrics["expected_calibration_error"]),
                tf.io.gfile.join(folder, "reliability.png"),
            )
            if len(self.class_names) <= MAX_MATRIX_CLASSES:
                paths["confusion_matrix.png"] = save_figure(
                    confusion_figure(self.metrics["confusion_matrix"], self.class_names),
                    tf.io.gfile.join(folder, "confusion_matrix.png"),
                )
        return paths


def confusion_csv(confusion, class_names):
    """The confusion matrix as CSV: a header of predicted classes, then a row per true class."""

    def cell(text):
        text = str(text)
        return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n') else text

    lines = ["true \\ predicted," + ",".join(cell(n) for n in class_names)]
    lines += [cell(name) + "," + ",".join(str(int(v)) for v in row) for name, row in zip(class_names, confusion)]
    return "\n".join(lines) + "\n"


def confusion_figure(confusion, class_names):
    """A matplotlib figure of the confusion matrix, each row normalised by its class's support (recall on the
    diagonal), the counts written in the cells for up to 20 classes."""
    from keras_vit.visualize.figures import pyplot

    plt = pyplot()
    confusion = np.asarray(confusion)
    rates = row_rates(confusion)
    n = len(class_names)
    side = min(4 + 0.35 * n, 24)
    figure, axis = plt.subplots(figsize=(side, side))
    image = axis.imshow(rates, cmap="Blues", vmin=0.0, vmax=1.0)
    figure.colorbar(image, ax=axis, fraction=0.046, pad=0.04, label="share of the true class")
    ticks = np.arange(n)
    fontsize = max(4, 10 - n // 15)
    axis.set_xticks(ticks, [str(c) for c in class_names], rotation=90, fontsize=fontsize)
    axis.set_yticks(ticks, [str(c) for c in class_names], fontsize=fontsize)
    axis.set_xlabel("predicted class")
    axis.set_ylabel("true class")
    if n <= 20:
        for i in range(n):
            for j in range(n):
                if confusion[i, j]:
                    axis.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=8,
                              color="white" if rates[i, j] > 0.5 else "black")
    axis.set_title("Confusion matrix")
    figure.tight_layout()
    return figure


def reliability_diagram(bins, ece=None):
    """A matplotlib reliability diagram: each bin's accuracy against its confidence range, hatched from there to
    the bin's mean confidence, the diagonal of perfect calibration, and the share of predictions in each bin
    below."""
    from keras_vit.visualize.figures import pyplot

    plt = pyplot()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    lower = np.array([b["lower"] for b in bins])
    width = np.array([b["upper"] - b["lower"] for b in bins])
    accuracy = np.array([b["accuracy"] for b in bins])
    confidence = np.array([b["confidence"] for b in bins])
    counts = np.array([b["count"] for b in bins], np.float64)
    filled = counts > 0
    top.bar(lower[filled], accuracy[filled], width=width[filled], align="edge", edgecolor="black", label="accuracy")
    # The gap from each bin's accuracy to its mean confidence, above (over-confident) or below it.
    top.bar(lower[filled], np.abs(confidence - accuracy)[filled], bottom=np.minimum(confidence, accuracy)[filled],
            width=width[filled], align="edge", facecolor="none", edgecolor="tab:red", hatch="//",
            label="gap to the mean confidence")
    top.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    top.set_ylabel("accuracy")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.legend(loc="upper left")
    top.set_title("Reliability diagram" + (f" (ECE {ece:.3f})" if ece is not None else ""))
    bottom.bar(lower, counts / max(counts.sum(), 1), width=width, align="edge", edgecolor="black")
    bottom.set_xlabel("confidence (top probability)")
    bottom.set_ylabel("share")
    figure.tight_layout()
    return figure


def predict_with_labels(model, batches, strategy=None):
    """(logits, labels) as NumPy arrays for every example of `batches` of (images, labels), in order.

    `model.predict` runs the model, so a strategy or a keras.distribution
    spreads the work as in training; the labels ride along through a wrapper
    model (built under `strategy`'s scope: by default the model's) that returns its label
    input beside the logits.  The wrapper is made once per model, strategy and
    kind of labels and kept on the model: every later call (another split, the
    same model with other weights loaded) runs the function traced the first
    time.  A last batch smaller than the first is padded to its size and the padding
    dropped from the answer (`_whole_batches`): every batch has one shape.
    """
    _, label_spec = batches.element_spec
    if strategy is None:  # TensorFlow: the strategy the model was built under (the default one if none).
        strategy = getattr(model, "distribute_strategy", None)
    key = (strategy, tuple(label_spec.shape[1:]), label_spec.dtype.name)
    # Kept in an object that is neither a Keras object nor a container, which Keras' saving passes by.
    wrappers = model.__dict__.setdefault("_keras_vit_label_predictors", _Wrappers()).models
    if key not in wrappers:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            image = keras.Input(model.input_shape[1:], dtype=model.inputs[0].dtype, name="image")
            label = keras.Input(label_spec.shape[1:], dtype=label_spec.dtype, name="label")
            real = keras.Input((), dtype="int32", name="real")  # Not bool: collectives gather no bool.
            wrappers[key] = keras.Model({"image": image, "label": label, "real": real}, [model(image), label, real])
    with _quiet_retracing():
        logits, labels, real = wrappers[key].predict(_whole_batches(batches), verbose=0)
    real = real.astype(bool)
    return logits[real], labels[real]


def _whole_batches(batches):
    """`batches` of (images, labels) as {"image", "label", "real"}, each batch at least as large as the first:
    a smaller one (the last of a split that the batch size does not divide) padded with zeros, "real" telling
    its examples (1) from the padding (0). So the predict step runs on one shape, compiled once under XLA (on a
    TPU a compile of the whole model), and a keras.distribution can split every batch across its devices (a
    last batch of 40 examples cannot be split across 16 devices)."""
    import tensorflow as tf

    @tf.autograph.experimental.do_not_convert  # No control flow to rewrite: traced as written, faster.
    def pad(size, batch):
        images, labels = batch
        count = tf.shape(images)[0]
        size = tf.maximum(size, count)  # The first batch's size (the state starts at 0).

        def padded(values):
            return tf.pad(values, [[0, size - count]] + [[0, 0]] * (len(values.shape) - 1))

        real = tf.cast(tf.range(size) < count, tf.int32)
        return size, {"image": padded(images), "label": padded(labels), "real": real}

    return batches.scan(tf.constant(0, tf.int32), pad)


class _Wrappers:
    def __init__(self):
        self.models = {}


class _RetracingNote(logging.Filter):
    def filter(self, record):
        return "triggered tf.function retracing" not in record.getMessage()


@contextlib.contextmanager
def _quiet_retracing():
    """Without TensorFlow's warning that a function is traced again and again: each wrapper model makes its own
    predict function, by design (one per model evaluated), and a job that evaluates a few models on a few splits
    would log it as if something were wrong."""
    logger, note = logging.getLogger("tensorflow"), _RetracingNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)


def evaluate(model, data, *, class_names=None, batch_size=64, strategy=None, top_k=5, num_bins=15):
    """Predicts `data` with `model` and reports it (`classification_report`), with images per second.

    Args:
        model: a Keras model returning logits.
        data: a `tf.data.Dataset` of (images, integer labels) batches, or
            a pair (images, labels) of arrays.
        class_names: the classes' names (default: the model's
            `class_names` when it has them, else their indices).
        batch_size: for arrays.
        strategy: a `tf.distribute.Strategy` the model was built under.

    Returns:
        An `Evaluation`.
    """
    class_names = class_names if class_names is not None else getattr(model, "class_names", None)
    start = time.perf_counter()
    if isinstance(data, (tuple, list)):
        images, labels = data
        logits = model.predict(np.asarray(images), batch_size=batch_size, verbose=0)
        labels = np.asarray(labels)
    else:
        logits, labels = predict_with_labels(model, data, strategy)
    seconds = time.perf_counter() - start
    if labels.ndim == 2 and labels.shape[1] == logits.shape[1]:  # one-hot
        labels = labels.argmax(axis=-1)
    names = list(class_names) if class_names is not None else [str(i) for i in range(logits.shape[1])]
    metrics = classification_report(logits, labels, class_names=names, top_k=top_k, num_bins=num_bins)
    metrics["images_per_second"] = len(labels) / seconds if seconds > 0 else None
    return Evaluation(metrics, names, np.asarray(logits), np.asarray(labels))


def confusion_image(confusion, size=256):
    """The confusion matrix as a uint8 (H, W, 3) heat map, each row normalised by its class's count, in
    matplotlib's "Blues" (as `confusion_figure`, without its axes and labels): a picture drawn in about a
    millisecond, for every epoch."""
    from matplotlib import colormaps

    rates = row_rates(confusion)
    cell = max(1, size // len(rates))
    colours = colormaps["Blues"](rates)[..., :3]
    return (np.repeat(np.repeat(colours, cell, axis=0), cell, axis=1) * 255).round().astype(np.uint8)


def rollout_images(model, images):
    """Each image beside itself weighted by the model's attention rollout (paper Figure 6): uint8
    (N, H, 2W, 3)."""
    from keras_vit.visualize import attention_rollout

    images = np.asarray(images, np.float32)
    maps = attention_rollout(model, images)[..., None]
    weighted = images * (0.15 + 0.85 * maps)
    return np.clip(np.concatenate([images, weighted], axis=2), 0, 255).astype(np.uint8)
