"""Canaries for keras_vit.compat: each fails, naming the API and the versions, when a private API it uses changes."""

import os
import pathlib
import platform

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_vit import compat, requirements
from keras_vit.compat import multi_worker, optimizers, probes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def versions():
    found = compat.installed_versions()
    return (
        f"written for Keras {compat.WRITTEN_FOR['keras']} / TensorFlow {compat.WRITTEN_FOR['tensorflow']}, "
        f"installed Keras {found['keras']} / TensorFlow {found['tensorflow']}"
    )


def major_minor(version):
    return tuple(int(part) for part in version.split(".")[:2])


def test_installed_versions_are_at_least_those_compat_is_checked_against():
    found = compat.installed_versions()
    for package in ("keras", "tensorflow"):
        assert major_minor(found[package]) >= major_minor(compat.CHECKED_FROM[package]), (
            f"keras_vit.compat was {versions()}, checked from {compat.CHECKED_FROM}: "
            "older versions may lack what its entries rely on."
        )
    assert major_minor(compat.CHECKED_FROM["tensorflow"]) == requirements.MINIMUM_TENSORFLOW


@pytest.mark.parametrize("entry", compat.ENTRIES)
def test_the_private_apis_each_entry_relies_on_exist(entry):
    problems = compat.api_problems(entry)
    assert not problems, (
        f"keras_vit.compat.{entry} relies on private APIs that changed ({versions()}): " + "; ".join(problems)
    )


def test_every_entry_is_in_the_table_and_names_its_versions():
    assert sorted(compat.ENTRIES) == sorted(compat.CHECKS)  # Each entry has its check, and is listed.
    for entry in compat.ENTRIES:
        assert f"`{entry}" in compat.__doc__, entry
        assert f"TensorFlow {compat.WRITTEN_FOR['tensorflow']}" in getattr(compat, entry).__doc__, entry
    for entry in ("ClipAfterAllReduce", "patch_keras_for_multi_worker_fit"):
        assert f"Keras {compat.WRITTEN_FOR['keras']}" in getattr(compat, entry).__doc__, entry
    with pytest.raises(ValueError, match=r"`entry` must be one of .*Received: entry='AutoTrackable'"):
        compat.api_problems("AutoTrackable")


# === oneDNN and XLA probes ===


def onednn_probe():
    """Whether oneDNN is on in this process and, where it is, the error and optimised op types of the kernels
    layer's FusedBatchNormV3 form of the layer norm."""
    from keras_vit.kernels.tf_cpu import layer_norm_for_inference

    result = {"onednn": compat.onednn_enabled()}
    if result["onednn"]:
        rng = np.random.default_rng(0)
        gamma = tf.constant(rng.normal(1.0, 0.2, 8).astype("float32"))
        beta = tf.constant(rng.normal(0.0, 0.2, 8).astype("float32"))
        function = tf.function(lambda x: layer_norm_for_inference(x, gamma, beta, 1e-6)).get_concrete_function(
            tf.TensorSpec([None, 5, 8])
        )
        # The pattern is a layer norm.
        x = rng.normal(0.0, 2.0, (3, 5, 8)).astype("float32")
        expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * gamma + beta
        result["error"] = float(np.abs(function(tf.constant(x)).numpy() - expected).max())
        result["ops"] = dict(compat.grappler_op_types(function))
    return result


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="TensorFlow's wheels are built with oneDNN on x86-64 Linux only",
)
@pytest.mark.parametrize("setting, expected", [
    pytest.param("1", True, marks=pytest.mark.environment("onednn_on")),
    pytest.param("0", False, marks=pytest.mark.environment("onednn_off")),
])
def test_onednn_enabled_follows_tensorflows_onednn_switch(setting, expected):
    """Built with oneDNN, TensorFlow runs it by default on some CPUs only; TF_ENABLE_ONEDNN_OPTS decides first."""
    assert os.environ.get("TF_ENABLE_ONEDNN_OPTS") == setting  # this test's child
    assert onednn_probe()["onednn"] is expected, (
        f"keras_vit.compat.onednn_enabled() is not {expected} with TF_ENABLE_ONEDNN_OPTS={setting} on "
        f"x86-64 Linux ({versions()}): IsMklEnabled no longer answers the question."
    )


def test_in_xla_context_is_true_only_in_xla_compiled_functions():
    seen = {}

    def traced(name):
        def function(x):
            seen[name] = compat.in_xla_context()

            def branch():  # A graph nested in the traced one answers like its parent.
                seen[f"{name}, in a cond branch"] = compat.in_xla_context()
                return x + 1.0

            return tf.cond(x[0] > 0, branch, lambda: x)

        return function

    tf.function(traced("xla"), jit_compile=True)(tf.ones([2]))
    tf.function(traced("plain"))(tf.ones([2]))
    traced("eager")(tf.ones([2]))
    expected = {
        "xla": True,
        "xla, in a cond branch": True,
        "plain": False,
        "plain, in a cond branch": False,
        "eager": False,
        "eager, in a cond branch": False,
    }
    assert seen == expected, f"compat.in_xla_context() answered {seen}, expected {expected} ({versions()})"


# === Frozen and optimised graphs ===


def test_convert_variables_to_constants_leaves_no_variable_ops():
    weights = tf.Variable(np.arange(6, dtype="float32").reshape(3, 2))
    function = tf.function(lambda x: tf.matmul(x, weights)).get_concrete_function(tf.TensorSpec([None, 3]))
    frozen = compat.convert_variables_to_constants(function)
    types = {op.type for op in frozen.graph.get_operations()}
    assert "ReadVariableOp" in {op.type for op in function.graph.get_operations()}
    assert not types & {"ReadVariableOp", "VarHandleOp", "ResourceGather"}, (
        f"compat.convert_variables_to_constants left variable ops {sorted(types)} ({versions()})"
    )
    x = np.ones((2, 3), "float32")
    weights.assign(tf.zeros([3, 2]))  # The frozen copy keeps the values it was made with.
    np.testing.assert_allclose(frozen(tf.constant(x))[0].numpy(), [[6.0, 9.0], [6.0, 9.0]])
    with pytest.raises(TypeError, match="expects a concrete function.*Received: Function"):
        compat.convert_variables_to_constants(tf.function(lambda x: x))


def test_grappler_op_types_returns_the_optimised_graph():
    """Grappler's constant folding is on in every build: two constant factors become one constant."""

    def scaled(x):
        return x * (tf.constant(2.0) * tf.constant(3.0))

    function = tf.function(scaled).get_concrete_function(tf.TensorSpec([None, 4]))
    traced = [op.type for op in function.graph.get_operations()]
    assert traced.count("Mul") == 2
    optimised = compat.grappler_op_types(function)
    assert optimised["Mul"] == 1 and optimised["Placeholder"] == 1, (
        f"compat.grappler_op_types did not return Grappler's output: {dict(optimised)} ({versions()})"
    )
    with pytest.raises(TypeError, match="expects a concrete function.*Received: function"):
        compat.grappler_op_types(scaled)


@pytest.mark.environment("onednn_on")
def test_grappler_rewrites_the_batch_norm_layer_norm_into_onednn_layer_norm():
    """With oneDNN on (forced, as CPUs without AVX-512 leave it off), Grappler fuses the kernels layer's
    FusedBatchNormV3 form of the layer norm (`tf_cpu.layer_norm_for_inference`) into one op."""
    assert os.environ["TF_ENABLE_ONEDNN_OPTS"] == "1"
    result = onednn_probe()
    if not result["onednn"]:
        pytest.skip("TensorFlow built without oneDNN: Grappler has no oneDNN layer norm to rewrite into")
    assert result["error"] < 1e-5, result
    ops = result["ops"]
    assert ops.get("_MklLayerNorm") == 1 and "FusedBatchNormV3" not in ops, (
        f"Grappler no longer rewrites the FusedBatchNormV3 layer norm into oneDNN's _MklLayerNorm: {ops} "
        f"({versions()})"
    )


# === Entries that raise when their private API changed ===


def test_a_changed_private_api_raises_naming_it_and_the_versions(monkeypatch):
    monkeypatch.setattr(multi_worker, "_TRAINER_ORIGINALS", {})  # As if not patched yet in this process.
    monkeypatch.setitem(
        multi_worker._TRAINER_FUNCTIONS, "TensorFlowTrainer._no_such_method", (("self",), True)
    )
    with pytest.raises(compat.PrivateApiError) as raised:
        compat.patch_keras_for_multi_worker_fit()
    message = str(raised.value)
    assert "keras_vit.compat.patch_keras_for_multi_worker_fit relies on private APIs that changed" in message
    assert "TensorFlowTrainer._no_such_method does not exist" in message
    assert f"written for Keras {compat.WRITTEN_FOR['keras']} and TensorFlow" in message
    assert f"found Keras {keras.version()}" in message
    assert not compat.multi_worker_fit_patched()


def test_clip_after_all_reduce_checks_its_private_apis_under_several_replicas(monkeypatch):
    from keras_vit import training

    monkeypatch.setitem(optimizers._OPTIMIZER_METHODS, "_no_such_method", ("self",))
    # One replica: the mixin only hands over to Keras, so nothing it relies on is checked.
    assert isinstance(training.SGD(0.1), training.SGD)
    monkeypatch.setattr(optimizers, "_multi_replica_strategy", lambda: True)
    with pytest.raises(compat.PrivateApiError, match=r"ClipAfterAllReduce .*_no_such_method does not exist"):
        training.SGD(0.1, global_clipnorm=1.0)


def test_the_probes_answer_false_when_their_api_is_missing(monkeypatch):
    """Only the two fast-path probes fall back, to the plain path; their canaries above still fail then."""
    monkeypatch.setattr(probes, "_MKL_PORT", ("tensorflow", "NoSuchProbe"))
    monkeypatch.setattr(probes, "_XLA_CONTEXT", ("tensorflow", "NoSuchProbe"))
    seen = []
    tf.function(lambda x: seen.append(compat.in_xla_context()) or x, jit_compile=True)(tf.ones([1]))
    assert seen == [False]
    assert compat.onednn_enabled() is False
    assert compat.api_problems("onednn_enabled") == ["tensorflow.NoSuchProbe does not exist"]
    assert compat.api_problems("in_xla_context") == ["tensorflow.NoSuchProbe does not exist"]


def test_after_one_save_of_a_vit_keras_saving_makes_no_reference_objects_and_the_file_is_the_same(tmp_path,
                                                                                               monkeypatch):
    from keras_vit import build_vit

    model = build_vit("testing", num_classes=3)
    keras.backend.clear_session()  # No skip set kept by earlier saves in this thread.
    model.save(tmp_path / "first.keras")
    made = []  # Keras' skip sets are made from a fresh Layer() (and Metric(), Optimizer()) each.
    initialize = keras.layers.Layer.__init__
    monkeypatch.setattr(keras.layers.Layer, "__init__",
                        lambda self, *args, **kwargs: made.append(1) or initialize(self, *args, **kwargs))
    model.save(tmp_path / "second.keras")
    assert made == []
    monkeypatch.undo()
    reloaded = keras.saving.load_model(tmp_path / "second.keras")
    assert [w.path for w in reloaded.weights] == [w.path for w in model.weights]
    for saved, loaded in zip(model.weights, reloaded.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(saved), keras.ops.convert_to_numpy(loaded))


def test_quantizing_a_vit_and_loading_it_quantized_collect_garbage_once_and_other_threads_as_usual(tmp_path,
                                                                                                 monkeypatch):
    """Keras' Layer.__delattr__ collects after each deleted kernel; ViT.quantize and the loading of its file
    collect once, and a thread collecting meanwhile gets Python's collection."""
    import contextlib
    import gc
    import threading

    from keras_vit import build_vit
    from keras_vit.testing import random_images

    collections = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(threading.get_ident()) or collect(*args))
    model = build_vit("testing", image_size=32, num_classes=3, num_layers=1)
    float_model = build_vit("testing", image_size=32, num_classes=3, num_layers=1)
    float_model.set_weights(model.get_weights())
    images = random_images((2, 32, 32, 3))
    deleted, others = [], []
    delete = keras.layers.Layer.__delattr__
    monkeypatch.setattr(keras.layers.Layer, "__delattr__",
                        lambda self, name: deleted.append(name) or delete(self, name))

    def collect_meanwhile():
        others.append(gc.collect() >= 0)  # Python's own: a count of what it found.

    other = threading.Thread(target=collect_meanwhile)
    with compat.one_collection_for_deleted_variables():
        other.start()
        other.join()
    assert collections == [other.ident, threading.get_ident()] and others == [True]
    collections.clear()
    model.quantize("int8")
    kernels = len(deleted)
    assert kernels > 1 and collections == [threading.get_ident()]  # Each kernel replaced; one collection.
    assert gc.collect is not collect and gc.collect() >= 0 and len(collections) == 2  # The test's counter again.
    model.save(tmp_path / "int8.keras")
    collections.clear()
    reloaded = keras.saving.load_model(tmp_path / "int8.keras")
    assert collections == [threading.get_ident()]
    np.testing.assert_array_equal(reloaded.predict(images, verbose=0), model.predict(images, verbose=0))
    # Quantized as Keras quantizes it, one collection per kernel: the same predictions.
    monkeypatch.setattr(compat, "one_collection_for_deleted_variables", contextlib.nullcontext)
    collections.clear()
    float_model.quantize("int8")
    assert len(collections) == kernels
    np.testing.assert_array_equal(float_model.predict(images, verbose=0), model.predict(images, verbose=0))
