"""`model.fit` under MultiWorkerMirroredStrategy: two reductions Keras gets wrong there, replaced."""

import importlib

import keras

from keras_vit.compat.apis import CHECKS, function_problems, lookup, names_used, parameters_problem, require

_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
_TRAINER_FUNCTIONS = {
    "TensorFlowTrainer._maybe_symbolic_build": (("self", "iterator", "data_batch"), True),
    "TensorFlowTrainer._symbolic_build": (("self", "iterator", "data_batch"), True),
    "reduce_per_replica": (("values", "strategy", "reduction"), True),
    "_collective_all_reduce_multi_worker": (("strategy",), True),
    "_is_per_replica_instance": (("obj",), True),
}
# The originals, once patched.
_TRAINER_ORIGINALS = {}


def _trainer_problems():
    trainer, problem = lookup(_TRAINER_MODULE, "TensorFlowTrainer")
    if problem:
        return [problem]
    problems = []
    for name, (expected, exact) in _TRAINER_FUNCTIONS.items():
        if name in _TRAINER_ORIGINALS:
            function = _TRAINER_ORIGINALS[name]
            problem = parameters_problem(function, f"{_TRAINER_MODULE}.{name}", expected, exact)
            problems += [problem] if problem else []
        else:
            problems += function_problems(_TRAINER_MODULE, name, expected, exact)
    # The replacements take effect only where Keras calls them by these names.
    if "_maybe_symbolic_build" not in names_used(getattr(trainer, "fit", None)):
        problems.append(f"{_TRAINER_MODULE}.TensorFlowTrainer.fit no longer calls _maybe_symbolic_build")
    if "reduce_per_replica" not in names_used(getattr(trainer, "_make_function", None)):
        problems.append(
            f"{_TRAINER_MODULE}.TensorFlowTrainer._make_function no longer calls the module's reduce_per_replica"
        )
    if "_distribute_strategy" not in names_used(getattr(trainer, "__init__", None)):
        problems.append(f"{_TRAINER_MODULE}.TensorFlowTrainer no longer sets `_distribute_strategy` in __init__")
    return problems


def patch_keras_for_multi_worker_fit():
    """Makes `model.fit` work under MultiWorkerMirroredStrategy (Keras 3, TensorFlow backend).

    Keras fails there in two places (keras-team/keras issue 20585, tensorflow/tensorflow issue 72388):

    1. `TensorFlowTrainer._maybe_symbolic_build` builds the model from one batch, which it first MEAN-reduces
       across replicas; under MultiWorkerMirroredStrategy that reduction is a collective op on the (uint8)
       image batch and fails.  The batch is only needed for its shapes and dtypes, so the replacement takes
       the local replica's value.
    2. `reduce_per_replica` MEAN-reduces the step's metrics with `axis=0`; they are scalars, so the collective
    reduction fails.  The replacement reduces scalars with `axis=None`.

    Both replacements act only under multi-worker collective strategies (as Keras' own
    `_collective_all_reduce_multi_worker` tells them) and call the original code everywhere else.  Idempotent.

    Written for Keras 3.15 with TensorFlow 2.21.  Relies on `keras.src.backend.tensorflow.trainer`: replaces
    `TensorFlowTrainer._maybe_symbolic_build(self, iterator=None, data_batch=None)` and the module function
    `reduce_per_replica(values, strategy, reduction)` (which the train and test steps look up by name), and
    calls `_collective_all_reduce_multi_worker(strategy)`, `_is_per_replica_instance(obj)`,
    `TensorFlowTrainer._symbolic_build` and reads `_distribute_strategy`.  No public API reaches either step:
    the failing reductions happen inside `fit` before any callback or `train_step` override runs.

    Raises PrivateApiError when any of those changed.
    """
    if _TRAINER_ORIGINALS:
        return
    require("patch_keras_for_multi_worker_fit")
    import tensorflow as tf

    trainer = importlib.import_module(_TRAINER_MODULE)
    is_multi_worker = trainer._collective_all_reduce_multi_worker
    is_per_replica = trainer._is_per_replica_instance
    original_build = trainer.TensorFlowTrainer._maybe_symbolic_build
    original_reduce = trainer.reduce_per_replica

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None or iterator is None or not is_multi_worker(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        for _, _, batches in iterator:
            data_batch = keras.tree.map_structure(
                lambda x: strategy.experimental_local_results(x)[0]
                if isinstance(x, tf.distribute.DistributedValues)
                else x,
                next(batches),
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if not (is_multi_worker(strategy) and reduction in ("auto", "mean")):
            return original_reduce(values, strategy, reduction)

        def reduce(value):
            if not (is_per_replica(value) or isinstance(value, tf.Tensor)):
                return value
            local = strategy.experimental_local_results(value)[0]
            return strategy.reduce("MEAN", value, axis=0 if local.shape.rank else None)

        return keras.tree.map_structure(reduce, values)

    _TRAINER_ORIGINALS.update(
        {
            "TensorFlowTrainer._maybe_symbolic_build": original_build,
            "TensorFlowTrainer._symbolic_build": trainer.TensorFlowTrainer._symbolic_build,
            "reduce_per_replica": original_reduce,
            "_collective_all_reduce_multi_worker": is_multi_worker,
            "_is_per_replica_instance": is_per_replica,
        }
    )
    trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    trainer.reduce_per_replica = reduce_per_replica


def multi_worker_fit_patched():
    """Whether `patch_keras_for_multi_worker_fit` has been applied in this process."""
    return bool(_TRAINER_ORIGINALS)



CHECKS["patch_keras_for_multi_worker_fit"] = _trainer_problems
