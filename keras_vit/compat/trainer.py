"""The running mean of the loss in a training step of keras_vit's own (`keras_vit.TrainingSteps`' gradient
accumulation), updated as Keras' step updates it."""

import keras

from keras_vit.compat.apis import CHECKS, function_problems, lookup, names_used, require, resolve

_UNSCALE = ("keras.src.losses.loss", "unscale_loss_for_distribution")
_TRAINER = ("keras.src.trainers.trainer", "Trainer")
_JAX_UPDATE = ("keras.src.backend.jax.trainer", "JAXTrainer._update_metrics_variables")
_JAX_UPDATE_PARAMETERS = ("self", "metrics_variables", "unscaled_loss", "x", "y", "y_pred", "sample_weight")
_SYMBOLIC_BUILD = ("keras.src.trainers.trainer", "Trainer._symbolic_build")


def track_loss(model, loss, x):
    """Adds `loss` (one micro-batch's, from `model.compute_loss`) to `model`'s running mean of the loss, weighted
    by the batch size of `x`, as Keras' TensorFlow training step does; under a `tf.distribute` strategy the
    loss is first multiplied back by the number of replicas (`compute_loss` divided it for the gradient sum).

    Written for Keras 3.15 with TensorFlow 2.21.  Relies on the model's private `_loss_tracker` (the
    `keras.metrics.Mean` named "loss" that `compile` makes and `fit` reports) and on
    `keras.src.losses.loss.unscale_loss_for_distribution(value)`.  A step that computes its own gradients (the
    documented way to customise `fit`) has no public way to feed the "loss" that `fit` logs: `compute_metrics`
    reads that tracker but does not update it.  Raises PrivateApiError when those changed.
    """
    unscale = resolve("track_loss", *_UNSCALE)
    first = next(tensor for tensor in keras.tree.flatten(x) if tensor is not None)
    model._loss_tracker.update_state(unscale(loss), sample_weight=keras.ops.shape(first)[0])


def update_metrics_stateless(model, metrics_variables, unscaled_loss, x, y, y_pred, sample_weight):
    """(logs, new metrics variables): `model`'s metrics and running mean of the loss updated with one
    micro-batch, on the values `metrics_variables` (the JAX trainer's state), as Keras' JAX training step
    does.

    Written for Keras 3.15 with TensorFlow 2.21.  Relies on the JAX trainer's private
    `_update_metrics_variables(metrics_variables, unscaled_loss, x, y, y_pred, sample_weight)`; the public
    `compute_metrics` does not update the loss's running mean, which lives in the private `_loss_tracker`.
    Raises PrivateApiError when it changed.
    """
    require("update_metrics_stateless")
    return model._update_metrics_variables(metrics_variables, unscaled_loss, x, y, y_pred, sample_weight)


def build_for_fit(model, batch):
    """Makes every variable `model.fit` would make before its first step (the model's, the optimizer's, the
    compiled loss's and metrics'), from the shapes and dtypes of `batch` alone: nothing is computed.

    Written for Keras 3.15 with TensorFlow 2.21.  Relies on the trainer's private `_symbolic_build(iterator,
    data_batch)`, which `fit` calls with its first batch; compiling a step ahead of time (`keras_vit.aot`) needs
    the same variables without a batch of real data or a step run.  Raises PrivateApiError when it changed.
    """
    require("build_for_fit")
    model._symbolic_build(data_batch=batch)


def _track_loss_problems():
    problems = function_problems(*_UNSCALE, ("value",), exact=True)
    trainer, problem = lookup(*_TRAINER)
    if problem:
        return problems + [problem]
    if "_loss_tracker" not in names_used(getattr(trainer, "compile", None)):
        problems.append(f"{'.'.join(_TRAINER)}.compile no longer sets `_loss_tracker`")
    return problems


def _update_metrics_problems():
    if keras.backend.backend() != "jax":
        return []  # Called on the JAX backend only; its module imports JAX.
    return function_problems(*_JAX_UPDATE, _JAX_UPDATE_PARAMETERS, exact=True)


CHECKS["track_loss"] = _track_loss_problems
CHECKS["update_metrics_stateless"] = _update_metrics_problems
CHECKS["build_for_fit"] = lambda: function_problems(*_SYMBOLIC_BUILD, ("self", "iterator", "data_batch"), exact=True)
