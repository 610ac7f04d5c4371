"""keras_vit.kernels: which form runs where. The layers hold no platform code, the kernels no state; each entry point
picks its form per trace, from the target read then (the backend, the device, oneDNN) and the table of forms."""

import pathlib
import re

import keras
import numpy as np
import pytest

from keras_vit import kernels
from keras_vit.kernels import policy, reference
from tests.kernel_helpers import HERE_AND_WITH_ONEDNN, graph_op_types, seeded, tensorflow_only, traced_op_types


def test_the_layers_hold_no_backend_or_device_specific_code():
    layers = pathlib.Path(kernels.__file__).parents[1] / "layers"
    sources = {path.name: path.read_text() for path in layers.glob("*.py")}
    assert {"attention.py", "embedding.py", "encoder.py"} <= set(sources)
    forbidden = r"import tensorflow|\btf\.|keras\.src|tensorflow\.python|backend\.backend\(\)|\bjax\b|\btorch\b|device"
    for name, text in sources.items():
        assert not re.search(forbidden, text), (name, re.search(forbidden, text).group(0))


def test_the_kernels_keep_no_module_level_state():
    """Nothing in `keras_vit.kernels` is remembered between traces: no module holds a mutable
    container or a function cache; the switches are context variables, set and restored by
    `portable_ops()`, `fused_attention()` and `cpu_serving()`."""
    import contextvars
    import importlib

    names = ["keras_vit.kernels", "keras_vit.kernels.policy", "keras_vit.kernels.reference", "keras_vit.kernels.fused"]
    if keras.backend.backend() == "tensorflow":
        names += ["keras_vit.kernels.tf_cpu", "keras_vit.kernels.tf_ops"]
    context_variables = []
    for name in names:
        for key, value in vars(importlib.import_module(name)).items():
            if key.startswith("__"):
                continue
            assert not isinstance(value, (set, dict, list, bytearray)), f"{name}.{key}"
            assert not hasattr(value, "cache_info"), f"{name}.{key} is a cached function"
            if isinstance(value, contextvars.ContextVar):
                context_variables.append(f"{name}.{key}")
    assert context_variables == [
        "keras_vit.kernels.policy._PORTABLE", "keras_vit.kernels.policy._FUSED_ATTENTION",
        "keras_vit.kernels.policy._CPU_SERVING",
    ]  # fmt: skip


@tensorflow_only
@HERE_AND_WITH_ONEDNN
@pytest.mark.parametrize("onednn", [True, False])
def test_each_cpu_form_is_chosen_where_the_table_says(monkeypatch, onednn, process):
    """The entry points' choices on TensorFlow on a CPU, with and without oneDNN."""
    import tensorflow as tf

    from keras_vit import compat

    monkeypatch.setattr(compat, "onednn_enabled", lambda: onednn)
    gamma, beta = np.ones(8, "float32"), np.zeros(8, "float32")

    def layer_norm_ops(training, dtype):
        spec = tf.TensorSpec((2, 5, 8), dtype)
        return traced_op_types(tf.function(lambda x: kernels.layer_norm(x, gamma, beta, 1e-6, training=training)), spec)

    inference = layer_norm_ops(False, tf.float32)
    assert ("FusedBatchNormV3" in inference) == onednn and "MatMul" not in inference, inference
    assert layer_norm_ops(True, tf.float32).count("MatMul") == 2  # Channel means as matmuls.
    assert not {"FusedBatchNormV3", "MatMul"} & set(layer_norm_ops(True, tf.bfloat16))  # The reference form.
    assert ("FusedBatchNormV3" in layer_norm_ops(False, tf.bfloat16)) == onednn
    with kernels.portable_ops():
        portable = layer_norm_ops(False, tf.float32) + layer_norm_ops(True, tf.float32)
        assert not {"FusedBatchNormV3", "MatMul"} & set(portable)

    def attention_ops(training, dtype, batch=4):
        spec = tf.TensorSpec((batch, 5, 24), dtype)
        return traced_op_types(tf.function(lambda x: kernels.attention(x, 2, training=training)), spec)

    assert "Softmax" not in attention_ops(True, tf.float32) and "Split" in attention_ops(True, tf.float32)
    assert "Split" in attention_ops(True, tf.bfloat16) and "Softmax" in attention_ops(True, tf.bfloat16)
    assert "Split" not in attention_ops(False, tf.float32)
    reference_casts = traced_op_types(
        tf.function(lambda x: reference.attention(x, 2)[0]), tf.TensorSpec((4, 5, 24), tf.bfloat16)
    )
    assert attention_ops(False, tf.bfloat16).count("Cast") == reference_casts.count("Cast") - 2 * onednn
    with kernels.portable_ops():
        assert "Split" not in attention_ops(True, tf.float32) and "Softmax" in attention_ops(True, tf.float32)


def _fake_accelerator(monkeypatch, kind):
    """Makes TensorFlow report a logical `kind` device ("GPU" or "TPU") as the kernels read it."""
    import tensorflow as tf

    real = tf.config.list_logical_devices

    def list_logical_devices(device_type=None):
        if device_type == kind:
            return [tf.config.LogicalDevice(name=f"/device:{kind}:0", device_type=kind)]
        return real(device_type)

    monkeypatch.setattr(tf.config, "list_logical_devices", list_logical_devices)


@tensorflow_only
def test_the_target_is_read_at_every_trace(monkeypatch):
    import tensorflow as tf

    assert kernels.current() == policy.Target("tensorflow", "cpu")
    assert kernels.current().tensorflow_cpu and not kernels.current().use_fused_attention
    with kernels.portable_ops():
        assert kernels.current().portable and not kernels.current().tensorflow_cpu
        with kernels.fused_attention(True):
            assert kernels.current().use_fused_attention
    assert not kernels.current().portable
    # A strategy's devices: two logical CPUs are a CPU.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        assert kernels.current().device == "cpu"
    for kind in ("GPU", "TPU"):
        with monkeypatch.context() as patch:
            _fake_accelerator(patch, kind)
            assert kernels.current().device == kind.lower() and not kernels.current().tensorflow_cpu
    assert kernels.current().device == "cpu"  # Nothing remembered.
    assert policy.device_kind(["/job:worker/replica:0/task:1/device:TPU:3"]) == "tpu"
    assert policy.device_kind(["cuda:0"]) == policy.device_kind(["gpu:1"]) == "gpu"
    assert policy.device_kind(["cpu:0", "/device:CPU:1"]) == "cpu"


def test_the_splash_guard_asks_the_policy(monkeypatch):
    """Keras' Splash route is kept off on JAX wherever the policy targets a TPU or JAX's default
    backend (what Keras reads) is one; never on other backends."""
    from keras_vit.kernels import fused

    for backend, target, default, want in (
        ("jax", "cpu", "cpu", False),
        ("jax", "gpu", "gpu", False),
        ("jax", "tpu", "tpu", True),
        ("jax", "cpu", "tpu", True),  # A keras.distribution over CPUs on a TPU machine.
        ("jax", "tpu", "cpu", True),
        ("torch", "tpu", "tpu", False),
    ):
        monkeypatch.setattr(policy, "current", lambda b=backend, t=target: policy.Target(b, t))
        monkeypatch.setattr(policy, "default_device", lambda backend=None, d=default: d)
        assert fused.keeps_off_keras_splash() is want, (backend, target, default)


def _small_model():
    import keras_vit

    model = keras_vit.build_vit(
        "testing", image_size=16, num_classes=5, num_layers=2, dropout_rate=0.1, classifier="token"
    )
    # Learning rate 0: fit steps leave the weights as they are, so predictions can be compared.
    model.compile(keras.optimizers.SGD(0.0), loss="sparse_categorical_crossentropy", jit_compile=True)
    return model


def _traced_ops(run):
    """The op types of every graph in which `run()` traces a kernel entry point."""
    import tensorflow as tf

    graphs = []
    current = policy.current

    def recording_current():
        graph = tf.compat.v1.get_default_graph()
        if graph not in graphs:
            graphs.append(graph)
        return current()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy, "current", recording_current)
        run()
    return [op for graph in graphs for op in graph_op_types(graph)]


@tensorflow_only
@pytest.mark.slow
@HERE_AND_WITH_ONEDNN
def test_a_model_traced_on_a_cpu_then_for_an_accelerator_gets_no_cpu_forms(monkeypatch, process):
    """Keras' predict and a fit step, traced for the CPU (after an eager call), then traced again
    for a (simulated) GPU: the first graphs carry the CPU forms, the second none of them. Where oneDNN
    is on here already (TensorFlow's default on some CPUs), the with_onednn run is this run: it runs
    there only."""
    from keras_vit import compat

    if process == "here" and compat.onednn_enabled():
        pytest.skip("oneDNN is on here, as in the onednn_on child: this run is the with_onednn one, which runs it")
    model = _small_model()
    images = seeded(8).integers(0, 256, (4, 16, 16, 3)).astype("float32")
    labels = np.arange(4) % 5
    model(images)  # An eager call first.

    def predict():
        return model.predict(images, batch_size=4, verbose=0)

    def fit():
        model.fit(images, labels, batch_size=4, epochs=1, verbose=0)

    def traced_for(kind):
        with monkeypatch.context() as patch:
            if kind:
                _fake_accelerator(patch, kind)
            model.make_predict_function(force=True)
            model.make_train_function(force=True)
            predictions = []
            predict_ops = _traced_ops(lambda: predictions.append(predict()))
            fit_ops = _traced_ops(fit)
        return predict_ops, predictions[0], fit_ops

    cpu_predict_ops, cpu_predictions, cpu_fit_ops = traced_for(None)
    gpu_predict_ops, gpu_predictions, gpu_fit_ops = traced_for("GPU")
    cpu_again = traced_for(None)

    # The CPU forms: oneDNN's layer norm subgraph (where TensorFlow has oneDNN) in predict; in the
    # XLA-compiled fit step the layer norms' channel means as matmuls, the attention's written-out
    # gradient (no Softmax) in two halves of the batch.
    assert ("FusedBatchNormV3" in cpu_predict_ops) == compat.onednn_enabled()
    assert "Softmax" in cpu_predict_ops
    assert "FusedBatchNormV3" not in cpu_fit_ops and "Softmax" not in cpu_fit_ops
    assert cpu_fit_ops.count("Split") >= 2

    cpu_only = {"FusedBatchNormV3", "PlaceholderWithDefault", "Split"}
    assert not cpu_only & set(gpu_predict_ops), sorted(cpu_only & set(gpu_predict_ops))
    assert not cpu_only & set(gpu_fit_ops), sorted(cpu_only & set(gpu_fit_ops))
    assert "Softmax" in gpu_fit_ops and gpu_fit_ops.count("Mean") > cpu_fit_ops.count("Mean")
    # And back on the CPU, its forms again: nothing was remembered.
    assert sorted(cpu_again[0]) == sorted(cpu_predict_ops) and sorted(cpu_again[2]) == sorted(cpu_fit_ops)
    # No op outside TensorFlow's own: a custom op would not be in tf.raw_ops.
    import tensorflow as tf

    unknown = {t for t in gpu_predict_ops + gpu_fit_ops if not hasattr(tf.raw_ops, t)}
    assert not unknown, unknown
    # Other forms, same numbers (the "GPU" graphs still run on this CPU).
    np.testing.assert_allclose(gpu_predictions, cpu_predictions, rtol=1e-4, atol=1e-5)


@tensorflow_only
def test_the_name_of_the_calling_function_does_not_choose_the_kernels():
    """A caller's function named like one of Keras' trainer functions traces what any other does."""
    import tensorflow as tf

    import keras_vit

    model = keras_vit.build_vit("testing", image_size=16, num_classes=5, num_layers=1)
    spec = tf.TensorSpec((2, 16, 16, 3))

    def one_step_on_data(x):
        return model(x, training=False)

    def serve(x):
        return model(x, training=False)

    same_name, other_name = (sorted(traced_op_types(tf.function(f), spec)) for f in (one_step_on_data, serve))
    assert same_name == other_name
    assert all(hasattr(tf.raw_ops, op) for op in same_name), sorted(set(same_name))
