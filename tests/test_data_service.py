"""tf.data service: a dispatcher and two workers on 127.0.0.1, the workers in processes of their own.

Workers in other processes are what a deployment has: they run the pipeline's serialized graph with none
of the client's Python, which in-process workers would hide.
"""

import collections
import doctest
import math
import os
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from keras_vit.data import service
from tests.conftest import ROOT


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker_process(dispatcher_port):
    """`python -m experiments.data_service --role=worker ...` on a free port; returns the process once it serves."""
    process = subprocess.Popen(
        [sys.executable, "-u", "-m", "experiments.data_service", "--role=worker",
         f"--dispatcher=127.0.0.1:{dispatcher_port}", f"--port={free_port()}"],
        cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )
    return process


def wait_until_serving(process, timeout=120):
    """Reads the process's output up to its "serving" line (printed once the worker has registered)."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if line.startswith("tf.data service worker on port"):
            return line
    raise AssertionError("The worker did not start:\n" + "".join(seen[-30:]))


@pytest.fixture
def cluster():
    """A dispatcher in this process and two worker processes; yields the dispatcher's address."""
    dispatcher = service.start_dispatcher(free_port())
    workers = []
    try:
        port = service.parse_address(dispatcher.target)[1]
        workers = [start_worker_process(port) for _ in range(2)]
        for worker in workers:
            wait_until_serving(worker)
        yield f"grpc://127.0.0.1:{port}"
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            worker.stdout.close()
        dispatcher.stop()


def test_addresses_and_arguments_are_checked():
    assert service.parse_address("grpc://10.0.0.2:5050") == ("10.0.0.2", 5050)
    assert service.parse_address("dispatcher.internal:1") == ("dispatcher.internal", 1)
    assert service.parse_address("[::1]:65535") == ("[::1]", 65535)
    for bad in ("localhost", "http://host:5050", "host:0", "host:65536", ":5050", "grpc://host", 5050, None):
        with pytest.raises(ValueError, match=r"'grpc://HOST:PORT' or 'HOST:PORT'.*Received: address="):
            service.parse_address(bad)
    ds = tf.data.Dataset.range(3)
    with pytest.raises(ValueError, match="Received: address='host:port'"):
        service.distribute(ds, "host:port", job_name="job")
    with pytest.raises(ValueError, match="Received: job_name=''"):
        service.distribute(ds, "host:5050", job_name="")
    with pytest.raises(ValueError, match="Received: processing_mode='one_epoch'"):
        service.distribute(ds, "host:5050", job_name="job", processing_mode="one_epoch")
    with pytest.raises(ValueError, match="Received: address='worker'"):
        service.start_worker("host:5050", worker_address="worker")


def test_docstring_examples():
    result = doctest.testmod(service, verbose=False)
    assert result.attempted >= 6 and result.failed == 0


def test_two_worker_processes_serve_a_pipeline(cluster):
    # "parallel_epochs": each worker produces the whole data set.
    squares = tf.data.Dataset.range(10).map(lambda x: x * x)
    counts = collections.Counter(int(x) for x in service.distribute(squares, cluster, job_name="squares"))
    assert counts == {x * x: 2 for x in range(10)}

    # "distributed_epoch": each element once, by one worker or the other.
    served = sorted(int(x) for x in service.distribute(squares, cluster, job_name="once",
                                                       processing_mode="distributed_epoch"))
    assert served == [x * x for x in range(10)]

    def repeats_of(ds, n=400):
        """How many values come twice among the first n: 0 for independent streams of random int64s."""
        values = [int(x) for x in service.distribute(ds, cluster, job_name="random").take(n)]
        return sum(count > 1 for count in collections.Counter(values).values())

    # A fixed seed is part of the graph: both workers produce one stream, every value twice.
    assert repeats_of(tf.data.Dataset.random(seed=3)) >= 100
    # Unseeded ops, but a global seed: their seeds derive from it in the client, the same on both workers.
    tf.random.set_seed(0)
    assert repeats_of(tf.data.Dataset.random()) >= 100
    # Built without a graph seed: each worker draws its own, whatever the global seed.
    assert repeats_of(service.on_each_worker(lambda: tf.data.Dataset.random())) == 0

    # A py_function is Python of this process: no worker process has it.
    python = tf.data.Dataset.range(3).map(lambda x: tf.py_function(lambda v: v + 1, [x], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="Could not find callback with key=pyfunc_"):
        list(service.distribute(python, cluster, job_name="python"))


@pytest.mark.slow
def test_training_through_the_service_runs_the_same_steps(cluster, tmp_path):
    """experiments.train on a folder of images, its input pipeline run by the two workers: as many steps
    as the same run on this host, finite metrics."""
    from experiments import train
    from experiments.configs import digits
    from tests.test_data import write_folder

    root = write_folder(tmp_path / "images", per_class=10, size=(24, 20))

    def run(data_service):
        config = digits.get_config()
        config.dataset = f"folder:{root}"
        config.image_size, config.batch_size, config.epochs, config.warmup_epochs = 16, 4, 2, 1
        config.model.patch_size, config.model.num_layers = 4, 1
        config.jit_compile = "off"
        config.verbose = 0
        config.data_service = data_service
        return train.train_and_evaluate(config, str(tmp_path / ("service" if data_service else "local")))

    local, served = run(""), run(cluster)
    assert served["steps"] == local["steps"] > 0
    assert served["steps"] == 2 * (served["train_examples"] // 4)
    for metrics in (local, served):
        finite = {key: value for key, value in metrics.items() if isinstance(value, float)}
        assert "test_accuracy" in finite and all(math.isfinite(value) for value in finite.values()), finite
