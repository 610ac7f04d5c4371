"""Multi-host training: two worker processes on 127.0.0.1 with MultiWorkerMirroredStrategy."""

import json
import os
import sys

import keras
import numpy as np
import pytest

import keras_vit  # noqa: F401  (registers the classes the saved models need)
from tests.builders import free_ports
from tests.conftest import run_together

WORKER = """
import json, os, signal, sys
import keras
from experiments import jobs, train
from experiments.configs import digits
from keras_vit.distribute import get_strategy
strategy = get_strategy("multi_worker")
config = digits.get_config()
config.epochs, config.visualize = 1, False  # the defaults otherwise, XLA as "auto" picks it
config.model.update(num_layers=1, hidden_dim=16, mlp_dim=32, num_heads=2)  # a small model: the sync is checked


class SignalAt(keras.callbacks.Callback):  # With argv[3] == "signal": SIGTERM to this process at its 5th step.
    def on_train_batch_end(self, batch, logs=None):
        if batch == 4 and sys.argv[3] == "signal":
            os.kill(os.getpid(), signal.SIGTERM)


try:
    metrics = train.train_and_evaluate(config, sys.argv[1], strategy, callbacks=[SignalAt()])
    print("METRICS " + json.dumps(metrics))
except jobs.Stopped as stopped:
    print("STOPPED", stopped.exit_code, stopped)
"""


def run_workers(workdir, signalled):
    """The two workers on 127.0.0.1, worker `signalled` (or none) sent SIGTERM at its 5th step: their outputs."""
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    commands = []
    for index in range(2):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")
        argv = [sys.executable, "-c", WORKER, str(workdir), str(index), "signal" if index == signalled else ""]
        commands.append((argv, env))
    return run_together(commands, timeout=600)


@pytest.mark.slow
def test_two_workers_stop_together_on_one_workers_sigterm_then_resume_and_train_the_epoch_in_sync(tmp_path):
    """Worker 1 alone gets SIGTERM mid-epoch; after that step every worker learns it (one all-reduce per step)
    and both stop there, each writing its backup. Run again, both resume at that step and end the epoch with
    the same weights."""
    stopped = run_workers(tmp_path, signalled=1)
    assert all("STOPPED 143 Stopped by SIGTERM at step" in output for output in stopped), stopped[0][-3000:]
    steps = [int(output.split("at step ", 1)[1].split()[0]) for output in stopped]
    assert steps[0] == steps[1] and 5 <= steps[0] < 1293 // 64, steps  # Together, mid-epoch.
    assert "Another worker was signalled" in stopped[0]
    for folder in (tmp_path / "backup", tmp_path / "workers" / "1" / "backup"):
        states = [json.loads(path.read_text()) for path in folder.glob("state-*.json")]
        assert [(state["epoch"], state["step"]) for state in states] == [(0, steps[0])]

    outputs = run_workers(tmp_path, signalled=None)
    metrics = [json.loads(o.split("METRICS ", 1)[1].splitlines()[0]) for o in outputs]
    # The global batch is split; the digits config holds out 144 of the 1,437 training images to validate on.
    assert metrics[0]["steps"] == metrics[1]["steps"] == 1293 // 64
    # The chief wrote into the workdir, worker 1 apart; both hold the same weights.
    chief = keras.saving.load_model(tmp_path / "model.keras")
    other = keras.saving.load_model(tmp_path / "workers" / "1" / "model.keras")
    for a, b in zip(chief.weights, other.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)
    assert metrics[0]["test_accuracy"] == metrics[1]["test_accuracy"]


# === Choosing the strategy, and what it means for XLA and the kernels ===


def test_auto_finds_the_tpu_of_a_tpu_vm_and_logs_its_choice(monkeypatch, caplog):
    """On a Cloud TPU VM (simulated: TensorFlow lists TPU devices), "auto" takes the local TPU
    with no flag or TPU_NAME; elsewhere one device. Each choice is logged with its replicas."""
    import logging

    import tensorflow as tf

    from keras_vit import distribute

    monkeypatch.delenv("TPU_NAME", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    caplog.set_level(logging.INFO)
    # The choice is logged through absl, whose logger a job run earlier in this process (its flags
    # parsed, --verbosity at its default) leaves at WARNING.
    caplog.set_level(logging.INFO, logger="absl")
    strategy = distribute.get_strategy("auto")
    # This machine's CPU: no strategy (TensorFlow's default, what `fit` uses outside every scope), so that
    # Keras reads the data itself; XLA's rule is that of one device.
    assert strategy is distribute.no_distribution() is tf.distribute.get_strategy()
    assert distribute.on_one_device(strategy) and not tf.distribute.has_strategy()
    assert "Strategy: none (TensorFlow's default strategy) with 1 replica(s) (auto: no TPU, no cluster, no GPU" in (
        caplog.text
    )
    assert isinstance(distribute.get_strategy("one_device"), tf.distribute.OneDeviceStrategy)

    asked = []

    class FakeTPUStrategy:
        num_replicas_in_sync = 8

    def tpu_strategy(tpu):
        asked.append(tpu)
        return FakeTPUStrategy()

    monkeypatch.setattr(distribute, "_tpu_strategy", tpu_strategy)
    monkeypatch.setattr(distribute, "local_tpu_devices", lambda: ["TPU:0", "TPU:1", "TPU:2", "TPU:3"])
    caplog.clear()
    assert isinstance(distribute.get_strategy("auto"), FakeTPUStrategy)
    assert asked == ["local"]
    assert "Strategy: FakeTPUStrategy with 8 replica(s) (auto: 4 local TPU device(s) found)" in caplog.text
    # A TPU named by flag or TPU_NAME goes first.
    monkeypatch.setenv("TPU_NAME", "my-tpu")
    distribute.get_strategy("auto")
    assert asked == ["local", None]


def test_a_named_tpu_that_cannot_be_reached_is_an_error_not_a_cpu_run(monkeypatch):
    from keras_vit import distribute

    monkeypatch.setenv("TPU_NAME", "no-such-tpu")
    with pytest.raises(ValueError, match="Could not resolve or initialise the TPU 'no-such-tpu'.*one_device"):
        distribute.get_strategy("auto")


def test_jit_compile_auto_follows_the_strategy(monkeypatch):
    """Keras' rule under tf.distribute (no XLA over several replicas), the platform's rule on one
    device; a strategy over a GPU is read as a GPU even on this CPU-only machine."""
    import tensorflow as tf

    from keras_vit import compat, distribute
    from keras_vit.training import resolve_jit_compile

    for onednn in (False, True):
        monkeypatch.setattr(compat, "onednn_enabled", lambda onednn=onednn: onednn)
        with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
            assert resolve_jit_compile("auto") is False
            assert resolve_jit_compile("on") is True  # An explicit choice stands.
        for one_device in (tf.distribute.OneDeviceStrategy("/cpu:0"), distribute.no_distribution()):
            with one_device.scope():
                assert resolve_jit_compile("auto") is True  # float32 training on a CPU
                assert resolve_jit_compile("auto", "mixed_bfloat16") is (not onednn)
            assert resolve_jit_compile("auto", strategy=one_device) is True
            assert resolve_jit_compile("auto", "mixed_bfloat16", strategy=one_device) is (not onednn)
        with tf.distribute.OneDeviceStrategy("/gpu:0").scope():
            assert resolve_jit_compile("auto", "mixed_bfloat16", training=False) is True
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        assert resolve_jit_compile("auto", strategy=strategy) is False


def _training_graph_ops(model, images):
    """The op types of one traced training step (forward and gradients) of `model`."""
    import tensorflow as tf

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec(images.shape, tf.float32)).graph
    return [op.type for op in graph.get_operations()]


def test_a_model_traced_on_the_cpu_first_gets_no_cpu_forms_under_a_gpu_strategy():
    """Traced for the CPU (an eager call and a training step), then under a real
    OneDeviceStrategy over a GPU (built here without one: tracing places nothing): the second
    trace carries none of the CPU forms, whatever the first did."""
    import tensorflow as tf

    model = keras_vit.build_vit("testing", image_size=16, num_classes=5, num_layers=1, classifier="token")
    images = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3)).astype("float32")
    model(images)
    cpu_ops = _training_graph_ops(model, images)
    with tf.distribute.OneDeviceStrategy("/gpu:0").scope():
        gpu_ops = _training_graph_ops(model, images)
    # The CPU's training forms: attention in two halves of the batch, its gradient written out
    # (no Softmax op); a GPU gets the reference form.
    assert "Split" in cpu_ops and "Softmax" not in cpu_ops, sorted(set(cpu_ops))
    assert "Split" not in gpu_ops and "Softmax" in gpu_ops, sorted(set(gpu_ops))
    cpu_only = {"FusedBatchNormV3", "PlaceholderWithDefault", "Split"}
    assert not cpu_only & set(gpu_ops)
