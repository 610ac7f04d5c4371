"""Short runs of one model on many small training sets (`experiments.scaling`, `experiments.transfer`).

`train_runs` trains a fresh model per (seed, training split), compiled once for all of them, for a fixed budget
or until its accuracy on a validation split stops improving (`BestOnValidation`); `accuracy` tests it;
`summarize` gathers the runs of one point.
"""

import time

import keras
import numpy as np

from experiments.models import compile_model, make_optimizer
from keras_vit import compat, training
from keras_vit import data as vit_data


def accuracy(model, split, batch_size):
    """Top-1 accuracy of `model` on every example of `split`, in inference mode.

    The images are padded to whole batches, so that every split is
    predicted in batches of one shape: one trace of the predict step.
    """
    padding = -len(split) % batch_size
    images = np.concatenate([split.images, np.zeros((padding, *split.images.shape[1:]), split.images.dtype)])
    logits = model.predict(images, batch_size=batch_size, verbose=0)[: len(split)]
    return float(np.mean(np.argmax(logits, axis=-1) == split.labels))


class BestOnValidation(keras.callbacks.Callback):
    """Early stopping for `train_runs`: the top-1 accuracy on `validation` after every epoch of `fit` (a
    fixed number of steps); training stops after `patience` evaluations without improvement, and the
    weights of the best evaluation (the earliest of equals) are put back at the end.  With a moving average
    of the weights (`use_ema`), the average is measured and kept."""

    def __init__(self, validation, batch_size, patience):
        super().__init__()
        self.validation, self.batch_size, self.patience = validation, batch_size, patience

    def on_train_begin(self, logs=None):
        self.best, self.best_step, self.best_weights, self.waited = -1.0, 0, None, 0

    def on_epoch_end(self, epoch, logs=None):
        # With a moving average of the weights (config.ema_momentum), the average is what is measured and kept.
        averaged = training.keeps_moving_average(self.model.optimizer)
        if averaged:
            compat.swap_moving_average(self.model.optimizer)
        try:
            score = accuracy(self.model, self.validation, self.batch_size)
            better = score > self.best
            if better:
                self.best, self.waited, self.best_weights = score, 0, self.model.get_weights()
                self.best_step = int(self.model.optimizer.iterations.numpy())
        finally:
            if averaged:
                compat.swap_moving_average(self.model.optimizer)
        if not better:
            self.waited += 1
            if self.waited >= self.patience:
                self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.best_weights is not None:
            self.model.set_weights(self.best_weights)


def train_runs(make_model, runs, test, *, config, steps, warmup_steps, batch_size, num_classes, recipe=None,
               validation=None, eval_every=100, patience=0):
    """Trains a model from `make_model()` for each (seed, training split) of `runs`; yields each result.

    Each run starts from the model `make_model()` builds after
    `keras.utils.set_random_seed(seed)`, and from a fresh optimizer state.
    The model is compiled once and its variables are set to the new model's
    for each later run, so that the training step is traced (and compiled by
    XLA) once for all the runs, not once per run.  Training draws batches of
    `batch_size` from the split, shuffled with `seed` and augmented with
    config.max_shift, for `steps` steps (the learning-rate schedule's
    length); with a `validation` split and `patience` > 0, it is evaluated
    there every `eval_every` steps and stops after `patience` evaluations
    without improvement, keeping the best evaluation's weights
    (`BestOnValidation`).  Then the test split is evaluated once.  Yields
    (model, result): the trained model, and a dict of `test_accuracy`,
    `train_accuracy` (on the run's own training images, unaugmented),
    `steps` (trained), `best_step` and `validation_accuracy` (with early
    stopping) and `seconds` (training and evaluation).
    """
    stopping = validation is not None and patience > 0
    if stopping and (eval_every < 1 or steps % eval_every):
        raise ValueError(
            f"Early stopping evaluates every `eval_every` steps, which must divide `steps`. Received: "
            f"eval_every={eval_every}, steps={steps}"
        )
    model = None
    for seed, train in runs:
        if batch_size > len(train):
            raise ValueError(
                f"A training set of {len(train)} examples is smaller than one batch of {batch_size}; "
                "use a smaller batch_size or larger fractions."
            )
        keras.utils.set_random_seed(seed)
        fresh = make_model()
        if model is None:
            model = compile_model(fresh, config, make_optimizer(config, steps, warmup_steps, recipe, model=fresh))
        else:
            # Weights, batch-norm statistics and the random generators' states (dropout).
            for variable, value in zip(model.variables, fresh.variables, strict=True):
                variable.assign(value)
            for variable in model.optimizer.variables:
                variable.assign(keras.ops.zeros_like(variable))
        start = time.perf_counter()
        batches = vit_data.make_pipeline(
            train, batch_size, training=True, num_classes=num_classes, seed=seed, max_shift=config.max_shift
        ).repeat()
        if stopping:
            best = BestOnValidation(validation, batch_size, patience)
            model.fit(batches, epochs=steps // eval_every, steps_per_epoch=eval_every, shuffle=False,
                      verbose=0, callbacks=[best])  # fmt: skip
        else:
            model.fit(batches, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
        result = {
            "test_accuracy": accuracy(model, test, batch_size),
            "train_accuracy": accuracy(model, train, batch_size),
            "steps": int(model.optimizer.iterations.numpy()),
        }
        if stopping:
            result.update(best_step=best.best_step, validation_accuracy=best.best)
        result["seconds"] = time.perf_counter() - start
        yield model, result


def summarize(results):
    """Per-seed lists of each result's fields, and the mean and standard deviation (ddof=1) of test accuracy."""
    summary = {key: [r[key] for r in results] for key in results[0]}
    accuracies = np.array(summary["test_accuracy"])
    summary["mean"] = float(accuracies.mean())
    summary["std"] = float(accuracies.std(ddof=1)) if len(accuracies) > 1 else 0.0
    return summary
