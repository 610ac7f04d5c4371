"""Multi-host training: two worker processes on 127.0.0.1 with MultiWorkerMirroredStrategy."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_vit  # noqa: F401  (registers the classes the saved models need)

ROOT = pathlib.Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
from experiments import train
from experiments.configs import digits
from keras_vit.distribute import get_strategy
strategy = get_strategy("multi_worker")
config = digits.get_config()
config.epochs, config.visualize, config.jit_compile = 1, False, "off"
config.model.num_layers = 1
metrics = train.train_and_evaluate(config, sys.argv[1], strategy)
print("METRICS " + json.dumps(metrics))
"""


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow
def test_two_workers_train_an_epoch_in_sync(tmp_path):
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    processes = []
    for index in range(2):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")
        processes.append(subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path)], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=600)[0])
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    metrics = [json.loads(o.split("METRICS ", 1)[1].splitlines()[0]) for o in outputs]
    assert metrics[0]["steps"] == metrics[1]["steps"] == 1437 // 64  # the global batch is split
    # The chief wrote into the workdir, worker 1 apart; both hold the same weights.
    chief = keras.saving.load_model(tmp_path / "model.keras")
    other = keras.saving.load_model(tmp_path / "workers" / "1" / "model.keras")
    for a, b in zip(chief.weights, other.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)
    assert metrics[0]["test_accuracy"] == metrics[1]["test_accuracy"]
