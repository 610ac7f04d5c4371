import os
import pathlib
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

# Shared with the benchmarks; test modules import them from here or from keras_vit.testing.
from keras_vit.testing import random_images, randomize_weights  # noqa: E402, F401

# The seed of Python's, NumPy's, TensorFlow's and Keras' global random generators at the start of
# every test: the same numbers in every run, whichever tests run and in whichever order.
SEED = 0


@pytest.fixture(autouse=True)
def seeded():
    """Seeds the global random generators before each test, so no test passes or fails by chance.

    Weight initialisers, dropout and `np.random` calls without a seed of their own then draw the
    same values in every run. Child processes (`run_module`) seed themselves: the entry points
    set `keras.utils.set_random_seed` from their config (`experiments.configs.common`: seed 0).
    """
    keras.utils.set_random_seed(SEED)


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and restores float32 after it."""

    def set_policy(name):
        keras.mixed_precision.set_global_policy(name)

    yield set_policy
    keras.mixed_precision.set_global_policy("float32")


ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_module(module, *args, timeout=900):
    """Runs `python -m module args...` from the repository root; returns its stdout."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="session")
def digits_main_job(tmp_path_factory):
    """The README's main command with its defaults, run once: (workdir, stdout)."""
    workdir = tmp_path_factory.mktemp("main_job") / "digits"
    return workdir, run_module("experiments.train", f"--workdir={workdir}")


# The fixtures that run once for several tests (a training job, a benchmark process): under pytest-xdist
# (`-n`, set in setup.cfg), every test that uses one runs on the same worker, so the fixture still runs once.
# tests/test_architecture.py checks that every module- or session-scoped fixture is listed here.
SHARED_FIXTURES = (
    "digits_main_job",
    "tensorflow_runs",
    "jax_runs",
    "mirrored_runs",
    "hybrid",
    "timm_reference",
    "torch_reference",
    "failed_writes",
    "small_saved_model",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Marks the tests that share a fixture with its group, and runs the groups first, the main job's
    (the longest piece of the suite) at the head: one worker starts it while the others take the rest."""
    rank = {}
    for item in items:
        shared = [name for name in SHARED_FIXTURES if name in item.fixturenames]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
        rank[item.nodeid] = SHARED_FIXTURES.index(shared[0]) if shared else len(SHARED_FIXTURES)
    items.sort(key=lambda item: rank[item.nodeid])


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (each worker holds its own TensorFlow and models)."""
    return max(1, min(4, os.cpu_count() or 1))
