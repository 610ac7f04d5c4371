"""The one module of keras_vit that uses private or undocumented Keras and TensorFlow APIs.

The rest of the package, `experiments/` and `tests/` use public APIs only, or the entries below.  Every entry was
written for the versions in `WRITTEN_FOR` and is checked down to `CHECKED_FROM`; its docstring says what it relies
on and why no public API does the job, and `tests/test_compat.py` holds a canary for each that fails, naming the API
and the versions, when what it relies on changes or goes away.

The entries, what each relies on, and who calls it:

- `onednn_enabled()`: tensorflow.python.util._pywrap_util_port.IsMklEnabled; the kernels layer, to choose a path (a
  probe).
- `in_xla_context()`: tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext; the kernels layer, to
  choose a path (a probe).
- `convert_variables_to_constants(f)`:
  tensorflow.python.framework.convert_to_constants.convert_variables_to_constants_v2; keras_vit.testing, for per-op
  profiles.
- `grappler_op_types(f)`: tensorflow.python.grappler.tf_optimizer.OptimizeGraph; tests of the kernels layer.
- `ClipAfterAllReduce`: the TensorFlow-backend optimizer's `_clip_gradients`, `_backend_update_step`,
  `_all_reduce_sum_gradients`, `_distributed_tf_update_step` and `_distribution_strategy`, and
  tf.__internal__.distribute.interim.maybe_merge_call; keras_vit.training.
- `LearningRateScales`: the optimizer's `_get_variable_index`, `_trainable_variables`, `_use_weight_decay` and
  `_apply_weight_decay`; keras_vit.training (layer-wise learning-rate decay).
- `swap_moving_average(optimizer)`: the optimizer's `_trainable_variables` and `_model_variables_moving_average`
  (its `use_ema` averages); keras_vit.training.EMAWeights.
- `patch_keras_for_multi_worker_fit()`: keras.src.backend.tensorflow.trainer
  (`TensorFlowTrainer._maybe_symbolic_build`, `reduce_per_replica`, `_collective_all_reduce_multi_worker`,
  `_is_per_replica_instance`); keras_vit.distribute.

When what an entry relies on is missing or has another signature, the entry raises `PrivateApiError` (a
RuntimeError) naming the API, the versions it was written for and the versions installed, rather than doing
something else. The two probes that only choose a faster path, `onednn_enabled` and `in_xla_context`, answer False
instead: the plain path is correct everywhere, only slower.

`api_problems(entry)` lists what an entry relies on that the installed versions lack ([] when all is there); the
canaries assert it is empty.

TensorFlow is imported inside the entries, so importing this module (as `keras_vit.training` does) works on the JAX
and PyTorch backends without TensorFlow installed.
"""

import collections
import functools
import importlib
import inspect
import logging
import types

import keras

WRITTEN_FOR = {"keras": "3.15", "tensorflow": "2.21"}
# The oldest versions the canaries run against (.ci/run's second environment: TensorFlow 2.20, the newest
# `tensorflow-tpu`); the entries work there too. Older ones are refused by keras_vit.requirements.
CHECKED_FROM = {"keras": "3.15", "tensorflow": "2.20"}

ENTRIES = (
    "onednn_enabled",
    "in_xla_context",
    "convert_variables_to_constants",
    "grappler_op_types",
    "ClipAfterAllReduce",
    "LearningRateScales",
    "swap_moving_average",
    "patch_keras_for_multi_worker_fit",
)


class PrivateApiError(RuntimeError):
    """A private Keras or TensorFlow API that a `keras_vit.compat` entry relies on is missing or changed."""


# === Finding private APIs and reporting what is missing ===


def installed_versions():
    """{"keras": ..., "tensorflow": ...}: the installed versions ("not installed" for an absent TensorFlow)."""
    try:
        import tensorflow as tf

        tensorflow_version = tf.__version__
    except ImportError:
        tensorflow_version = "not installed"
    return {"keras": keras.version(), "tensorflow": tensorflow_version}


def _versions_sentence():
    found = installed_versions()
    return (
        f"written for Keras {WRITTEN_FOR['keras']} and TensorFlow {WRITTEN_FOR['tensorflow']}, "
        f"found Keras {found['keras']} and TensorFlow {found['tensorflow']}"
    )


def _lookup(module_name, qualified_name):
    """(the object, None), or (None, why it cannot be found)."""
    try:
        found = importlib.import_module(module_name)
    except ImportError as error:
        return None, f"{module_name} cannot be imported ({error})"
    for part in qualified_name.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            return None, f"{module_name}.{qualified_name} does not exist"
    return found, None


def _parameters_problem(function, name, expected, exact):
    """None when `function` takes `expected` (exactly, or as its leading parameters)."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return f"{name} has no signature to check"
    matches = parameters == list(expected) if exact else parameters[: len(expected)] == list(expected)
    if matches:
        return None
    wanted = "exactly" if exact else "starting with"
    return f"{name} takes ({', '.join(parameters)}); expected parameters {wanted} ({', '.join(expected)})"


def _names_used(function):
    """The global and attribute names `function`'s code (its nested functions included) refers to."""
    if function is not None:
        function = inspect.unwrap(function)  # Past decorators such as Keras' traceback filter.
    code = getattr(function, "__code__", None)
    pending, names = [code] if code is not None else [], set()
    while pending:
        code = pending.pop()
        names.update(code.co_names)
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def _function_problems(module_name, qualified_name, expected, exact=False):
    function, problem = _lookup(module_name, qualified_name)
    if problem:
        return [problem]
    if not callable(function):
        return [f"{module_name}.{qualified_name} is not callable"]
    if expected is None:  # A compiled function: no Python signature to compare.
        return []
    problem = _parameters_problem(function, f"{module_name}.{qualified_name}", expected, exact)
    return [problem] if problem else []


def api_problems(entry):
    """What `entry` relies on that the installed Keras and TensorFlow lack or changed; [] when all is there."""
    if entry not in _CHECKS:
        raise ValueError(f"`entry` must be one of {ENTRIES}. Received: entry={entry!r}")
    return _CHECKS[entry]()


def _require(entry):
    problems = api_problems(entry)
    if problems:
        raise PrivateApiError(
            f"keras_vit.compat.{entry} relies on private APIs that changed: {'; '.join(problems)} "
            f"({_versions_sentence()})."
        )


def _resolve(entry, module_name, qualified_name):
    """The private object `entry` calls, or PrivateApiError when it or anything else `entry` needs is off."""
    _require(entry)
    return _lookup(module_name, qualified_name)[0]


# === oneDNN and XLA probes (fast-path choice; False when the API is missing) ===

_MKL_PORT = ("tensorflow.python.util._pywrap_util_port", "IsMklEnabled")


def onednn_enabled():
    """Whether TensorFlow runs its oneDNN CPU kernels and graph rewrites in this process.

    True only in a build with oneDNN (the x86-64 Linux wheels), where it is on: TF_ENABLE_ONEDNN_OPTS=1 or 0 decides
    when set, and otherwise TensorFlow decides from the CPU's features (it leaves oneDNN off on some CPUs, AVX2-only
    ones among them).  Grappler rewrites graphs into oneDNN's fused ops (such as `_MklLayerNorm`) only when this is
    True.

    Written for TensorFlow 2.21.  Relies on `tensorflow.python.util._pywrap_util_port.IsMklEnabled()`, the check
    TensorFlow's own code and tests use.  No public API reports it: `tf.sysconfig.get_build_info()` has no oneDNN
    key.

    A probe for choosing a faster path: False when the private API is missing (the canary in tests/test_compat.py
    still fails then).
    """
    probe, _ = _lookup(*_MKL_PORT)
    return bool(probe()) if callable(probe) else False


_XLA_CONTEXT = ("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext")


def in_xla_context():
    """Whether ops traced now are compiled by XLA: inside a `tf.function(jit_compile=True)`.

    True when the current default graph, or a graph it is nested in (a `tf.cond` or `tf.while_loop` branch, an inner
    `tf.function`), is traced for XLA, as Keras' `jit_compile=True` traces each training step.  False eagerly and in
    graphs TensorFlow runs itself.

    Written for TensorFlow 2.21.  Relies on `tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext`,
    which reads the XLA marker TensorFlow sets on graphs it compiles.  No public API tells whether the function
    being traced will be compiled.

    A probe for choosing a faster path: False when the private API is missing (the canary in tests/test_compat.py
    still fails then).
    """
    try:
        import tensorflow as tf
    except ImportError:
        return False
    if tf.executing_eagerly():
        return False
    probe, _ = _lookup(*_XLA_CONTEXT)
    return bool(probe(tf.compat.v1.get_default_graph())) if callable(probe) else False


# === Frozen and optimised graphs ===

_CONVERT = ("tensorflow.python.framework.convert_to_constants", "convert_variables_to_constants_v2")


def _check_concrete_function(entry, concrete_function):
    import tensorflow as tf

    if not isinstance(concrete_function, tf.types.experimental.ConcreteFunction):
        raise TypeError(
            f"keras_vit.compat.{entry} expects a concrete function (`tf.function(f).get_concrete_function(spec)`). "
            f"Received: {type(concrete_function).__name__}"
        )


def convert_variables_to_constants(concrete_function):
    """A copy of `concrete_function` with every variable it reads replaced by a constant of its value.

    The frozen graph can be imported into a `tf.Graph` and run by a session with no variables to initialise, which
    is how TensorFlow collects its own per-op step statistics after its graph optimiser has run.

    Written for TensorFlow 2.21.  Relies on
    `tensorflow.python.framework.convert_to_constants.convert_variables_to_constants_v2(func)`. The public
    `tf.compat.v1.graph_util.convert_variables_to_constants` works on TF1 sessions and graph defs only, not on TF2
    concrete functions.
    """
    _check_concrete_function("convert_variables_to_constants", concrete_function)
    convert = _resolve("convert_variables_to_constants", *_CONVERT)
    return convert(concrete_function)


_OPTIMIZE_GRAPH = ("tensorflow.python.grappler.tf_optimizer", "OptimizeGraph")


def grappler_op_types(concrete_function):
    """`collections.Counter` of the op types in `concrete_function`'s graph after TensorFlow's Grappler ran.

    The graph is optimised as a session on this machine would before running it: every node placed on the local CPU,
    the function's outputs fetched, its inputs fed, Grappler with its default passes (a default ConfigProto). That
    is where oneDNN's fusions happen (FusedBatchNormV3-based layer norms into `_MklLayerNorm`, MatMul + BiasAdd +
    activation into one op, ...). Some fusions need constant weights (the layer norm's scale and offset, for one):
    pass `convert_variables_to_constants(f)` to see the graph a frozen model gets.  Ops inside functions the graph
    still calls are not counted.

    Written for TensorFlow 2.21.  Relies on `tensorflow.python.grappler.tf_optimizer.OptimizeGraph(config_proto,
    metagraph, verbose)`, the Python entry point TensorFlow's own Grappler tests use.  No public API returns the
    graph Grappler produces: sessions and tf.function run it internally and never hand it back.
    """
    _check_concrete_function("grappler_op_types", concrete_function)
    optimize = _resolve("grappler_op_types", *_OPTIMIZE_GRAPH)
    import tensorflow as tf

    graph = concrete_function.graph
    meta_graph = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
    cpu = tf.config.list_logical_devices("CPU")[0].name
    for node in meta_graph.graph_def.node:
        node.device = node.device or cpu
    # Grappler keeps what the "train_op" collection names: the fetches.
    fetches = meta_graph.collection_def["train_op"].node_list.value
    fetches.extend(tensor.name for tensor in concrete_function.outputs)
    optimized = optimize(tf.compat.v1.ConfigProto(), meta_graph, verbose=False)
    return collections.Counter(node.op for node in optimized.node)


# === Clipping the all-reduced gradient ===

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
                for problem in _function_problems("keras.optimizers", f"Optimizer.{name}", expected, exact=True)]
    built = set().union(*(_names_used(cls.__dict__.get("build")) for cls in keras.optimizers.Optimizer.__mro__))
    return problems + [f"keras.optimizers.Optimizer.build no longer sets `{name}`" for name in attributes - built]


def _optimizer_problems():
    if keras.backend.backend() != "tensorflow":
        return []  # The mixin does nothing on other backends.
    optimizer = keras.optimizers.Optimizer
    problems = _base_optimizer_problems(_OPTIMIZER_METHODS, set())
    # Keras clips, then calls the backend update step that all-reduces; the mixin moves the clip after it.
    used = _names_used(getattr(optimizer, "_backend_apply_gradients", None))
    missing = ", ".join(sorted({"_clip_gradients", "_backend_update_step"} - used))
    problems += [f"keras.optimizers.Optimizer._backend_apply_gradients no longer calls {missing}"] if missing else []
    if not any("_distribution_strategy" in _names_used(cls.__dict__.get("__init__")) for cls in optimizer.__mro__):
        problems.append("keras.optimizers.Optimizer no longer sets `_distribution_strategy` in __init__")
    problems += _function_problems(*_MERGE_CALL, ("fn", "strategy"))
    return problems


def _multi_replica_strategy():
    """Whether optimizers created now belong to a strategy with several replicas (TensorFlow backend)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync > 1


class ClipAfterAllReduce:
    """Mixin for Keras optimizers: clip the global gradient after the cross-replica sum, not before.

    Keras clips in `_backend_apply_gradients` (`_clip_gradients`), then `_backend_update_step` all-reduces the
    clipped per-replica gradients across replicas, so under a multi-replica strategy `global_clipnorm` clips each
    replica's share on its own and the update depends on the number of replicas.  With this mixin, clipping is
    skipped there and done in `_backend_update_step` on the all-reduced gradient, between Keras'
    `_all_reduce_sum_gradients` and `_distributed_tf_update_step` (run through `maybe_merge_call`, as Keras does):
    the update a single device makes with the same global batch.  With one replica (or another backend) it changes
    nothing.

    Written for Keras 3.15 with TensorFlow 2.21.  Relies on the TensorFlow-backend optimizer's private
    `_clip_gradients(grads)`, `_backend_update_step(grads, trainable_variables, learning_rate)`,
    `_all_reduce_sum_gradients(grads_and_vars)`, `_distributed_tf_update_step(distribution, grads_and_vars,
    learning_rate)`, its `_distribution_strategy` attribute and
    `tf.__internal__.distribute.interim.maybe_merge_call`.  No public hook runs between the cross-replica sum and
    the update; clipping in the public `apply` would need a second all-reduce of every gradient.

    Created under a multi-replica strategy, an optimizer with this mixin raises PrivateApiError when those APIs
    changed, rather than clipping per replica without saying so.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if _multi_replica_strategy():
            _require("ClipAfterAllReduce")

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
        merge_call = _resolve("ClipAfterAllReduce", *_MERGE_CALL)
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
    parameter groups), multiplied by its factor in `learning_rate_scales` ({variable.path: factor}; 1 for a variable
    not named).  Without scales, the optimizer is Keras' own.

    Written for Keras 3.15 with TensorFlow 2.21.  `update_step(gradient, variable, learning_rate)` is the method to
    override, but it receives the variable (under a `tf.distribute` strategy, one replica's copy), not its name: the
    factor is found through the private `_get_variable_index` and `_trainable_variables`, and the weight decay,
    applied here at the scaled rate instead of in `_apply_weight_decay` at one rate for all, through the private
    `_use_weight_decay`.  No public hook takes a per-variable rate.  Made with scales, it raises PrivateApiError
    when those APIs changed.
    """

    def __init__(self, *args, learning_rate_scales=None, **kwargs):
        super().__init__(*args, **kwargs)
        scales = {str(path): float(scale) for path, scale in (learning_rate_scales or {}).items()}
        if any(not scale >= 0 for scale in scales.values()):
            raise ValueError(f"Learning-rate scales must be >= 0. Received: {scales}")
        if scales:
            _require("LearningRateScales")
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
        if not self._scale_items:  # Otherwise in update_step, at each variable's own rate.
            super()._apply_weight_decay(variables)

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


def swap_moving_average(optimizer):
    """Exchanges, exactly, the values of the model's trainable variables and of `optimizer`'s moving average
    of them (`use_ema=True`, or a `LossScaleOptimizer` around such an optimizer).  Outside the training step: under
    a `tf.distribute` strategy, in its cross-replica context, where an assignment reaches every replica.

    Written for Keras 3.15 with TensorFlow 2.21.  The averages are the private `_model_variables_moving_average`, in
    the order of the private `_trainable_variables`; no public API reads them.  (`keras.callbacks.SwapEMAWeights`
    swaps by adding and subtracting, which rounds.)  Raises PrivateApiError when those attributes are gone.
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if not getattr(optimizer, "use_ema", False):
        raise ValueError(f"The optimizer keeps no moving average (use_ema=False): {type(optimizer).__name__}.")
    if not optimizer.built:
        return  # Nothing trained yet: no average.
    _require("swap_moving_average")
    for variable, average in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average):
        if average is not None:
            current = keras.ops.copy(variable.value)
            variable.assign(average.value)
            average.assign(current)


# === model.fit under MultiWorkerMirroredStrategy ===

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
    trainer, problem = _lookup(_TRAINER_MODULE, "TensorFlowTrainer")
    if problem:
        return [problem]
    problems = []
    for name, (expected, exact) in _TRAINER_FUNCTIONS.items():
        if name in _TRAINER_ORIGINALS:
            function = _TRAINER_ORIGINALS[name]
            problem = _parameters_problem(function, f"{_TRAINER_MODULE}.{name}", expected, exact)
            problems += [problem] if problem else []
        else:
            problems += _function_problems(_TRAINER_MODULE, name, expected, exact)
    # The replacements take effect only where Keras calls them by these names.
    if "_maybe_symbolic_build" not in _names_used(getattr(trainer, "fit", None)):
        problems.append(f"{_TRAINER_MODULE}.TensorFlowTrainer.fit no longer calls _maybe_symbolic_build")
    if "reduce_per_replica" not in _names_used(getattr(trainer, "_make_function", None)):
        problems.append(
            f"{_TRAINER_MODULE}.TensorFlowTrainer._make_function no longer calls the module's reduce_per_replica"
        )
    if "_distribute_strategy" not in _names_used(getattr(trainer, "__init__", None)):
        problems.append(f"{_TRAINER_MODULE}.TensorFlowTrainer no longer sets `_distribute_strategy` in __init__")
    return problems


def patch_keras_for_multi_worker_fit():
    """Makes `model.fit` work under MultiWorkerMirroredStrategy (Keras 3, TensorFlow backend).

    Keras fails there in two places (keras-team/keras issue 20585, tensorflow/tensorflow issue 72388):

    1. `TensorFlowTrainer._maybe_symbolic_build` builds the model from one batch, which it first MEAN-reduces across
    replicas; under MultiWorkerMirroredStrategy that reduction is a collective op on the (uint8) image batch and
    fails.  The batch is only needed for its shapes and dtypes, so the replacement takes the local replica's value.
    2. `reduce_per_replica` MEAN-reduces the step's metrics with `axis=0`; they are scalars, so the collective
    reduction fails.  The replacement reduces scalars with `axis=None`.

    Both replacements act only under multi-worker collective strategies (as Keras' own
    `_collective_all_reduce_multi_worker` tells them) and call the original code everywhere else.  Idempotent.

    Written for Keras 3.15 with TensorFlow 2.21.  Relies on `keras.src.backend.tensorflow.trainer`: replaces
    `TensorFlowTrainer._maybe_symbolic_build(self, iterator=None, data_batch=None)` and the module function
    `reduce_per_replica(values, strategy, reduction)` (which the train and test steps look up by name), and calls
    `_collective_all_reduce_multi_worker(strategy)`, `_is_per_replica_instance(obj)`,
    `TensorFlowTrainer._symbolic_build` and reads `_distribute_strategy`.  No public API reaches either step: the
    failing reductions happen inside `fit` before any callback or `train_step` override runs.

    Raises PrivateApiError when any of those changed.
    """
    if _TRAINER_ORIGINALS:
        return
    _require("patch_keras_for_multi_worker_fit")
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


# === The canaries' view ===


def _mkl_problems():
    return _function_problems(*_MKL_PORT, None)


def _xla_context_problems():
    return _function_problems(*_XLA_CONTEXT, ("graph",))


_CHECKS = {
    "onednn_enabled": _mkl_problems,
    "in_xla_context": _xla_context_problems,
    "convert_variables_to_constants": functools.partial(_function_problems, *_CONVERT, ("func",)),
    "grappler_op_types": functools.partial(
        _function_problems, *_OPTIMIZE_GRAPH, ("config_proto", "metagraph", "verbose")
    ),
    "ClipAfterAllReduce": _optimizer_problems,
    "LearningRateScales": functools.partial(_base_optimizer_problems, _SCALE_METHODS, {"_trainable_variables"}),
    "swap_moving_average": functools.partial(_base_optimizer_problems, {}, _EMA_ATTRIBUTES),
    "patch_keras_for_multi_worker_fit": _trainer_problems,
}
