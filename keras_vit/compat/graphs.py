"""Frozen and optimised TensorFlow graphs: what the graph optimiser makes of a function (per-op profiles)."""

import collections
import functools

from keras_vit.compat.apis import CHECKS, function_problems, resolve

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

    The frozen graph can be imported into a `tf.Graph` and run by a session with no variables to initialise,
    which is how TensorFlow collects its own per-op step statistics after its graph optimiser has run.

    Written for TensorFlow 2.21.  Relies on
    `tensorflow.python.framework.convert_to_constants.convert_variables_to_constants_v2(func)`. The public
    `tf.compat.v1.graph_util.convert_variables_to_constants` works on TF1 sessions and graph defs only, not on
    TF2 concrete functions.
    """
    _check_concrete_function("convert_variables_to_constants", concrete_function)
    convert = resolve("convert_variables_to_constants", *_CONVERT)
    return convert(concrete_function)


_OPTIMIZE_GRAPH = ("tensorflow.python.grappler.tf_optimizer", "OptimizeGraph")


def grappler_op_types(concrete_function):
    """`collections.Counter` of the op types in `concrete_function`'s graph after TensorFlow's Grappler ran.

    The graph is optimised as a session on this machine would before running it: every node placed on the
    local CPU, the function's outputs fetched, its inputs fed, Grappler with its default passes (a default
    ConfigProto). That is where oneDNN's fusions happen (FusedBatchNormV3-based layer norms into
    `_MklLayerNorm`, MatMul + BiasAdd + activation into one op, ...). Some fusions need constant weights (the
    layer norm's scale and offset, for one): pass `convert_variables_to_constants(f)` to see the graph a
    frozen model gets.  Ops inside functions the graph still calls are not counted.

    Written for TensorFlow 2.21.  Relies on
    `tensorflow.python.grappler.tf_optimizer.OptimizeGraph(config_proto, metagraph, verbose)`, the Python
    entry point TensorFlow's own Grappler tests use.  No public API returns the graph Grappler produces:
    sessions and tf.function run it internally and never hand it back.
    """
    _check_concrete_function("grappler_op_types", concrete_function)
    optimize = resolve("grappler_op_types", *_OPTIMIZE_GRAPH)
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



CHECKS["convert_variables_to_constants"] = functools.partial(function_problems, *_CONVERT, ("func",))
CHECKS["grappler_op_types"] = functools.partial(
    function_problems, *_OPTIMIZE_GRAPH, ("config_proto", "metagraph", "verbose")
)
