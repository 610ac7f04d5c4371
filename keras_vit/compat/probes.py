"""Probes that choose a faster path: whether oneDNN is on, whether the step being traced is compiled by XLA.

Both answer False when the private API they read is missing: the plain path is correct everywhere, only
slower.
"""

from keras_vit.compat.apis import CHECKS, function_problems, lookup

_MKL_PORT = ("tensorflow.python.util._pywrap_util_port", "IsMklEnabled")


def onednn_enabled():
    """Whether TensorFlow runs its oneDNN CPU kernels and graph rewrites in this process.

    True only in a build with oneDNN (the x86-64 Linux wheels), where it is on: TF_ENABLE_ONEDNN_OPTS=1 or 0
    decides when set, and otherwise TensorFlow decides from the CPU's features (it leaves oneDNN off on some
    CPUs, AVX2-only ones among them).  Grappler rewrites graphs into oneDNN's fused ops (such as
    `_MklLayerNorm`) only when this is True.

    Written for TensorFlow 2.21.  Relies on `tensorflow.python.util._pywrap_util_port.IsMklEnabled()`, the
    check TensorFlow's own code and tests use.  No public API reports it: `tf.sysconfig.get_build_info()` has
    no oneDNN key.

    A probe for choosing a faster path: False when the private API is missing (the canary in
    tests/test_compat.py still fails then).
    """
    probe, _ = lookup(*_MKL_PORT)
    return bool(probe()) if callable(probe) else False


_XLA_CONTEXT = ("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext")


def in_xla_context():
    """Whether ops traced now are compiled by XLA: inside a `tf.function(jit_compile=True)`.

    True when the current default graph, or a graph it is nested in (a `tf.cond` or `tf.while_loop` branch, an
    inner `tf.function`), is traced for XLA, as Keras' `jit_compile=True` traces each training step.  False
    eagerly and in graphs TensorFlow runs itself.

    Written for TensorFlow 2.21.  Relies on
    `tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext`, which reads the XLA marker
    TensorFlow sets on graphs it compiles.  No public API tells whether the function being traced will be
    compiled.

    A probe for choosing a faster path: False when the private API is missing (the canary in
    tests/test_compat.py still fails then).
    """
    try:
        import tensorflow as tf
    except ImportError:
        return False
    if tf.executing_eagerly():
        return False
    probe, _ = lookup(*_XLA_CONTEXT)
    return bool(probe(tf.compat.v1.get_default_graph())) if callable(probe) else False



CHECKS["onednn_enabled"] = lambda: function_problems(*_MKL_PORT, None)
CHECKS["in_xla_context"] = lambda: function_problems(*_XLA_CONTEXT, ("graph",))
