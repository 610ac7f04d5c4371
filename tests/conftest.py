import os
import pathlib
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and restores float32 after it."""

    def set_policy(name):
        keras.mixed_precision.set_global_policy(name)

    yield set_policy
    keras.mixed_precision.set_global_policy("float32")


def randomize_weights(model, seed=0, scale=0.2):
    """Replaces every weight by random values, so no term of the forward pass is a no-op.

    Zero biases, unit LayerNorm scales, a zero head or class token would hide a
    missing or misplaced term from a parity test.
    """
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        value = rng.normal(0.0, scale, weight.shape)
        if weight.name == "gamma":
            value += 1.0
        weight.assign(value.astype(weight.dtype))
    return model


def random_images(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape).astype("float32")


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
