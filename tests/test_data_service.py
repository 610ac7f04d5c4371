"""tf.data service: a dispatcher and two workers on 127.0.0.1, each in a process of its own, started once for
the tests that use them.

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


class Servers:
    """Two worker processes, and with `work_dir` a dispatcher process journaling there, started at once.

    Their output goes to files in the folder `logs`.  `address()` waits until they serve, so that a test
    can do something else while they start; `stop()` terminates them."""

    def __init__(self, logs, dispatcher_port, *, work_dir=None):
        self.port, self.started = dispatcher_port, []
        try:
            if work_dir:
                self.start(logs / "dispatcher.log", "--role=dispatcher", f"--port={dispatcher_port}",
                           f"--work_dir={work_dir}")
            for i in range(2):
                self.start(logs / f"worker{i}.log", "--role=worker", f"--dispatcher=127.0.0.1:{dispatcher_port}",
                           f"--port={free_port()}")
        except BaseException:
            self.stop()
            raise

    def start(self, log, *flags):
        with open(log, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-u", "-m", "experiments.data_service", *flags],
                cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), stdout=out, stderr=subprocess.STDOUT,
            )
        self.started.append((process, log))

    def address(self, timeout=180):
        """The dispatcher's address, once every process prints that it serves (a worker: once registered)."""
        deadline = time.monotonic() + timeout
        for process, log in self.started:
            while "tf.data service " not in log.read_text():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{log.name} did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
        return f"grpc://127.0.0.1:{self.port}"

    def stop(self):
        for process, _ in self.started:
            process.terminate()
        for process, _ in self.started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def deployed_service(tmp_path_factory):
    """A dispatcher process (fault tolerant: journaling into its folder `dispatcher`) and two worker processes,
    as `python -m experiments.data_service` starts them, once for this file's tests; yields (the dispatcher's
    address, journal folder) once they serve."""
    folder = tmp_path_factory.mktemp("data_service")
    work_dir = folder / "dispatcher"
    servers = Servers(folder, free_port(), work_dir=work_dir)
    try:
        yield servers.address(), work_dir
    finally:
        servers.stop()


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


@pytest.mark.slow  # Its fixture starts three processes that import TensorFlow: 10-16 s.
def test_two_worker_processes_serve_a_pipeline(deployed_service):
    cluster, _ = deployed_service
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
def test_training_through_the_service_runs_the_same_steps(deployed_service, tmp_path):
    """experiments.train on a folder of images, its input pipeline run by the two workers: as many steps
    as the same run on this host, finite metrics, and the training image that fails to decode (on a
    worker, graph-only) skipped and named here.  The per-epoch TensorBoard figures and the figures after
    training are off: they read the validation and test splits, on this host, in both runs alike."""
    address, journal = deployed_service
    from experiments import train
    from experiments.configs import digits
    from tests.builders import write_folder

    root = write_folder(tmp_path / "images", per_class=10, size=(24, 20), corrupt=["cat/broken.png"])

    def run(data_service):
        config = digits.get_config()
        config.dataset = f"folder:{root}"
        config.image_size, config.batch_size, config.epochs, config.warmup_epochs = 16, 4, 2, 1
        config.model.update(patch_size=4, num_layers=1, hidden_dim=16, mlp_dim=32, num_heads=2)
        config.jit_compile = "off"
        config.verbose = 0
        config.visualize, config.tensorboard_figures = False, 0
        config.data_service = data_service
        return train.train_and_evaluate(config, str(tmp_path / ("service" if data_service else "local")))

    def jobs():
        """The bytes of the dispatcher's journal: the datasets registered and the jobs made, by name."""
        return b"".join(path.read_bytes() for path in journal.rglob("*") if path.is_file())

    local = run("")
    assert b"keras_vit_train" not in jobs()
    served = run(address)
    assert b"keras_vit_train-" in jobs()  # The training pipeline's job: read from the workers.
    assert served["steps"] == local["steps"] > 0
    assert served["steps"] == 2 * (served["train_examples"] // 4)
    # The broken file falls in the training split (the split's seed is fixed): only the workers decode it.
    assert served["skipped_files"] == local["skipped_files"] == 1
    assert served["skipped_examples"] == local["skipped_examples"] == [f"{root}/cat/broken.png"]
    for metrics in (local, served):
        finite = {key: value for key, value in metrics.items() if isinstance(value, float)}
        assert "test_accuracy" in finite and all(math.isfinite(value) for value in finite.values()), finite
