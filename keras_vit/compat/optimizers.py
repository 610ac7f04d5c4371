"""Optimizer mixins and helpers: clipping the all-reduced gradient, per-variable learning rates (layer-wise
decay), and swapping in the moving average of the weights."""

import functools
import logging

import keras

from keras_vit.compat.apis import CHECKS, function_problems, lookup, names_used, require, resolve

_OPTIMIZER_METHODS = {
    "_clip_gradients": ("self", "grads"),
    "_backend_update_step": ("self", "grads", "trainable_variables", "learning_rate"),
    "_all_reduce_sum_gradients": ("self", "grads_and_vars"),
    "_distributed_tf_update_step": ("self", "distribution", "grads_and_vars", "learning_rate"),
}
_MERGE_CALL = ("tensorflow", "__internal__.distribute.interim.maybe_merge_call")


def _base_optimizer_problems(methods, attributes):
    """`methods` of keras.optimizers.Optimizer with their parameters, and `attributes` its `build` sets."""
    problems = [problem for name, expected in methods.items()
                for problem in function_problems("keras.optimizers", f"Optimizer.{name}", expected, exact=True)]
    built = set().union(*(names_used(cls.__dict__.get("build")) for cls in keras.optimizers.Optimizer.__mro__))
    return problems + [f"keras.optimizers.Optimizer.build no longer sets `{name}`" for name in attributes - built]


def _optimizer_problems():
    if keras.backend.backend() != "tensorflow":
        return []  # The mixin does nothing on other backends.
    optimizer = keras.optimizers.Optimizer
    problems = _base_optimizer_problems(_OPTIMIZER_METHODS, set())
    # Keras clips, then calls the backend update step that all-reduces; the mixin moves the clip after it.
    used = names_used(getattr(optimizer, "_backend_apply_gradients", None))
    missing = ", ".join(sorted({"_clip_gradients", "_backend_update_step"} - used))
    problems += [f"keras.optimizers.Optimizer._backend_apply_gradients no longer calls {missing}"] if missing else []
    return problems + _merge_call_problems()


def _merge_call_problems():
    """What updating every replica's variables from the replica context relies on: the optimizer's
    `_distribution_strategy` and TensorFlow's `maybe_merge_call`."""
    problems = []
    if not any("_distribution_strategy" in names_used(cls.__dict__.get("__init__"))
               for cls in keras.optimizers.Optimizer.__mro__):  # fmt: skip
        problems.append("keras.optimizers.Optimizer no longer sets `_distribution_strategy` in __init__")
    return problems + function_problems(*_MERGE_CALL, ("fn", "strategy"))


def _multi_replica_strategy():
    """Whether optimizers created now belong to a strategy with several replicas (TensorFlow backend)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync > 1


class ClipAfterAllReduce:
    """Mixin for Keras optimizers: clip the global gradient after the cross-replica sum, not before.

    Keras clips in `_backend_apply_gradients` (`_clip_gradients`), then `_backend_update_step` all-reduces the
    clipped per-replica gradients across replicas, so under a multi-replica strategy `global_clipnorm` clips
    each replica's share on its own and the update depends on the number of replicas.  With this mixin,
    clipping is skipped there and done in `_backend_update_step` on the all-reduced gradient, between Keras'
    `_all_reduce_sum_gradients` and `_distributed_tf_update_step` (run through `maybe_merge_call`, as Keras
    does): the update a single device makes with the same global batch.  With one replica (or another backend)
    it changes nothing.

    Written for Keras 3.15 with TensorFlow 2.21.  Relies on the TensorFlow-backend optimizer's private
    `_clip_gradients(grads)`, `_backend_update_step(grads, trainable_variables, learning_rate)`,
    `_all_reduce_sum_gradients(grads_and_vars)`, `_distributed_tf_update_step(distribution, grads_and_vars,
    learning_rate)`, its `_distribution_strategy` attribute and
    `tf.__internal__.distribute.interim.maybe_merge_call`.  No public hook runs between the cross-replica sum
    and the update; clipping in the public `apply` would need a second all-reduce of every gradient.

    Created under a multi-replica strategy, an optimizer with this mixin raises PrivateApiError when those
    APIs changed, rather than clipping per replica without saying so.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if _multi_replica_strategy():
            require("ClipAfterAllReduce")

    def _multi_replica(self):
        if keras.backend.backend() != "tensorflow":
            return False
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        return context is not None and context.num_replicas_in_sync > 1

    def _clip_gradients(self, grads):
        if self._multi_replica():
            return grads  # Clipped in _backend_update_step, once summed.
        return super()._clip_gradients(grads)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if not self._multi_replica():
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        merge_call = resolve("ClipAfterAllReduce", *_MERGE_CALL)
        variables = [v.value if isinstance(v, keras.Variable) else v for v in trainable_variables]
        summed = self._all_reduce_sum_gradients(list(zip(grads, variables)))
        clipped = super()._clip_gradients([g for g, _ in summed])
        merge_call(
            self._distributed_tf_update_step,
            self._distribution_strategy,
            list(zip(clipped, variables)),
            learning_rate,
        )


# === Per-variable learning rates (layer-wise decay) and the moving average of the weights ===

_SCALE_METHODS = {"_get_variable_index": ("self", "variable"), "_use_weight_decay": ("self", "variable"),
                  "_apply_weight_decay": ("self", "variables"),
                  "update_step": ("self", "gradient", "variable", "learning_rate")}  # fmt: skip
_EMA_ATTRIBUTES = {"_trainable_variables", "_model_variables_moving_average"}


class LearningRateScales:
    """Mixin for Keras optimizers: each variable's learning rate, and its decoupled weight decay (as in PyTorch's
    parameter groups), multiplied by its factor in `learning_rate_scales` ({variable.path: factor}; 1 for a
    variable not named).  Without scales, the updates are Keras' own.

    Written for Keras 3.15 with TensorFlow 2.21.  `update_step(gradient, variable, learning_rate)` is the
    method to override, but it receives the variable (under a `tf.distribute` strategy, one replica's copy),
    not its name: the factor is found through the private `_get_variable_index` and `_trainable_variables`,
    and the weight decay, applied here at the scaled rate instead of in `_apply_weight_decay` at one rate for
    all, through the private `_use_weight_decay`.  No public hook takes a per-variable rate.  Made with
    scales, it raises PrivateApiError when those APIs changed.

    Without scales, on TensorFlow, the weight decay is Keras' (the same assignments, in the same order) with the
    learning rate computed once per step: Keras' TensorFlow `_apply_weight_decay` evaluates the learning-rate
    schedule again for every variable, so that the training step's graph holds one copy of the schedule per
    variable to trace and compile.  It runs through the private `_distribution_strategy`, `_use_weight_decay`
    and tf.__internal__.distribute.interim.maybe_merge_call, as Keras' does; where those changed, Keras' own
    method runs instead (the same values, traced per variable).
    """

    def __init__(self, *args, learning_rate_scales=None, **kwargs):
        super().__init__(*args, **kwargs)
        scales = {str(path): float(scale) for path, scale in (learning_rate_scales or {}).items()}
        if any(not scale >= 0 for scale in scales.values()):
            raise ValueError(f"Learning-rate scales must be >= 0. Received: {scales}")
        if scales:
            require("LearningRateScales")
        self._scale_items = tuple(sorted(scales.items()))

    @property
    def learning_rate_scales(self):
        return dict(self._scale_items)

    def build(self, variables):
        super().build(variables)
        if unknown := sorted(set(self.learning_rate_scales) - {variable.path for variable in variables}):
            message = "%d learning-rate scales name no variable this optimizer updates (e.g. %s): another model's?"
            logging.getLogger("keras_vit").warning(message, len(unknown), unknown[:3])

    def _apply_weight_decay(self, variables):
        if self._scale_items:
            return  # In update_step, at each variable's own rate.
        if self.weight_decay is None or keras.backend.backend() != "tensorflow" or _decay_problems():
            super()._apply_weight_decay(variables)
            return
        merge_call = lookup(*_MERGE_CALL)[0]
        merge_call(self._distributed_weight_decay, self._distribution_strategy, variables, self.learning_rate)

    def _distributed_weight_decay(self, distribution, variables, learning_rate):
        """Keras' weight decay for TensorFlow (in the cross-replica context, each variable updated on every
        replica), at `learning_rate`."""
        import tensorflow as tf

        def decay(variable, learning_rate):
            if self._use_weight_decay(variable):
                rate, factor = tf.cast(learning_rate, variable.dtype), tf.cast(self.weight_decay, variable.dtype)
                variable.assign_sub(variable * factor * rate)

        for variable in variables:
            variable = variable.value if isinstance(variable, keras.Variable) else variable
            distribution.extended.update(variable, decay, args=(learning_rate,), group=False)

    def update_step(self, gradient, variable, learning_rate):
        if self._scale_items:
            path = self._trainable_variables[self._get_variable_index(variable)].path
            learning_rate = keras.ops.cast(learning_rate, variable.dtype) * self.learning_rate_scales.get(path, 1.0)
            if self.weight_decay is not None and self._use_weight_decay(variable):
                decay = keras.ops.cast(self.weight_decay, variable.dtype) * learning_rate
                self.assign_sub(variable, variable * decay)
        return super().update_step(gradient, variable, learning_rate)

    def get_config(self):
        return {**super().get_config(), "learning_rate_scales": self.learning_rate_scales}


def _decay_problems():
    """What the weight decay with one learning rate relies on that is missing (TensorFlow backend)."""
    return _base_optimizer_problems({"_use_weight_decay": ("self", "variable")}, set()) + _merge_call_problems()


def swap_moving_average(optimizer):
    """Exchanges, exactly, the values of the model's trainable variables and of `optimizer`'s moving average
    of them (`use_ema=True`, or a `LossScaleOptimizer` around such an optimizer).  Outside the training step:
    under a `tf.distribute` strategy, in its cross-replica context, where an assignment reaches every replica.

    Written for Keras 3.15 with TensorFlow 2.21.  The averages are the private
    `_model_variables_moving_average`, in the order of the private `_trainable_variables`; no public API reads
    them.  (`keras.callbacks.SwapEMAWeights` swaps by adding and subtracting, which rounds.)  Raises
    PrivateApiError when those attributes are gone.
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if not getattr(optimizer, "use_ema", False):
        raise ValueError(f"The optimizer keeps no moving average (use_ema=False): {type(optimizer).__name__}.")
    if not optimizer.built:
        return  # Nothing trained yet: no average.
    require("swap_moving_average")
    for variable, average in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average):
        if average is not None:
            current = keras.ops.copy(variable.value)
            variable.assign(average.value)
            average.assign(current)



CHECKS["ClipAfterAllReduce"] = _optimizer_problems
CHECKS["LearningRateScales"] = functools.partial(_base_optimizer_problems, _SCALE_METHODS, {"_trainable_variables"})
CHECKS["swap_moving_average"] = functools.partial(_base_optimizer_problems, {}, _EMA_ATTRIBUTES)
