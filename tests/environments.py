"""Tests that need an interpreter of their own, run together: one child pytest per environment.

Some checks can only run in a process set up before Keras or TensorFlow is imported: another Keras backend,
the CPU split into logical devices, TensorFlow hidden as on a machine without it, oneDNN switched on or off.
A test asks for one with `@pytest.mark.environment(NAME)` (or a parameter with that mark). In the main
session such a test does not run here: the first of them starts one child `python -m pytest` for NAME with
every selected test of NAME, and each test reports its own outcome from the child (a failure with the
child's traceback, a skip with its reason). The child is an ordinary pytest session: fixtures, `tmp_path`,
the seeding and the timeouts of tests/conftest.py apply there as here.

An environment whose variables are a part of another's runs its tests in that one's child (RUN_IN). Under
pytest-xdist the tests of one child are one group (tests/scheduling.py), so each child runs once.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each environment: the variables its child starts with.
ENVIRONMENTS = {
    # TensorFlow with the CPU as two logical devices: MirroredStrategy with two replicas; oneDNN on (onednn_on's
    # tests run here too).
    "two_cpus": {"KERAS_VIT_TEST_LOGICAL_CPUS": "2", "TF_ENABLE_ONEDNN_OPTS": "1"},
    # Keras' JAX backend on two CPU devices (keras.distribution over two); TensorFlow importable (tf.data), with
    # oneDNN off (onednn_off's tests run here too: JAX does the arithmetic, TensorFlow only reads the data).
    "jax": {
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "TF_ENABLE_ONEDNN_OPTS": "0",
    },
    # Keras' JAX backend on eight CPU devices with TensorFlow hidden: a JAX machine without TensorFlow.
    "jax_without_tensorflow": {
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "KERAS_VIT_TEST_HIDE_TENSORFLOW": "1",
    },
    # TensorFlow's oneDNN graph rewrites on, and off, whatever this CPU's default is.
    "onednn_on": {"TF_ENABLE_ONEDNN_OPTS": "1"},
    "onednn_off": {"TF_ENABLE_ONEDNN_OPTS": "0"},
}

# Environments whose tests run in another one's child, which sets their variables too: one child fewer to start.
RUN_IN = {"onednn_on": "two_cpus", "onednn_off": "jax"}
assert all(ENVIRONMENTS[name].items() <= ENVIRONMENTS[host].items() for name, host in RUN_IN.items())
# The environments that have a child of their own.
CHILDREN = [name for name in ENVIRONMENTS if name not in RUN_IN]

# The environment this process is, in a child; None in the main session.
CURRENT = os.environ.get("KERAS_VIT_TEST_ENVIRONMENT")
# Where a child writes its tests' outcomes.
REPORT = os.environ.get("KERAS_VIT_TEST_REPORT")
# Variables of the main session that would mislead a child (it is no xdist worker).
NOT_INHERITED = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_CURRENT_TEST")


class HideTensorFlow:
    """A meta-path finder under which `import tensorflow` fails as it does where no build is installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")
        return None


def prepare():
    """What a child sets up before Keras is imported (tests/conftest.py calls this first)."""
    if os.environ.get("KERAS_VIT_TEST_HIDE_TENSORFLOW"):
        sys.meta_path.insert(0, HideTensorFlow())
    cpus = int(os.environ.get("KERAS_VIT_TEST_LOGICAL_CPUS", "0"))
    if cpus:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cpus)


def environment_of(item):
    """The environment a test item asks for, or None; an unknown name is an error."""
    marker = item.get_closest_marker("environment")
    if marker is None:
        return None
    name = marker.args[0] if marker.args else None
    if name not in ENVIRONMENTS:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.environment({name!r}); expected one of {sorted(ENVIRONMENTS)}"
        )
    return name


def child_of(item):
    """The child that runs a test item (its environment's, or the one its environment runs in), or None."""
    name = environment_of(item)
    return RUN_IN.get(name, name)


def test_id(item):
    """The test's node id as a child names it: without the "@group" that pytest-xdist appends here."""
    return item.nodeid.removesuffix(f"@environment_{child_of(item)}")


def timeout_of(item):
    """The test's timeout in seconds (its `timeout` mark, which tests/conftest.py sets for every test)."""
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker and marker.args else 60.0


class Children:
    """Runs each environment's child once, for every selected test of that environment, on first need."""

    def __init__(self, session, folder):
        self.session, self.folder = session, folder
        self.runs = {}

    def outcome(self, item):
        """{"outcome", "text", "seconds"} of `item` in its environment's child, or None if it did not run."""
        name = child_of(item)
        if name not in self.runs:
            self.runs[name] = self.run(name, [i for i in self.session.items if child_of(i) == name])
        reports, output = self.runs[name]
        found = reports.get(test_id(item))
        if found is None:
            return {"outcome": "failed", "seconds": 0.0,
                    "text": f"The {name!r} child did not run this test. Its output ended with:\n{output[-5000:]}"}
        return found

    def run(self, name, items):
        report = self.folder / f"{name}.json"
        env = {key: value for key, value in os.environ.items() if key not in NOT_INHERITED}
        env.update(ENVIRONMENTS[name], KERAS_VIT_TEST_ENVIRONMENT=name, KERAS_VIT_TEST_REPORT=str(report))
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # The suite's options but xdist's: the child runs its tests one after the other.
        command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-ra",
                   "--strict-markers", "--rootdir", ROOT, *map(test_id, items)]  # fmt: skip
        timeout = 60 + sum(timeout_of(item) for item in items)
        try:
            result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            output = result.stdout + result.stderr
        except subprocess.TimeoutExpired as error:
            output = f"The child ran past {timeout:.0f} s.\n{error.stdout or ''}{error.stderr or ''}"
        reports = json.loads(report.read_text()) if report.exists() else {}
        return reports, output


# === In the child: each test's outcome, written for the main session ===

_OUTCOMES = {}


def record(report):
    """pytest_runtest_logreport in a child: folds the phases of each test into one outcome."""
    entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "text": "", "seconds": 0.0})
    entry["seconds"] += report.duration
    if report.failed:
        entry.update(outcome="failed", text=f"({report.when}) {report.longreprtext}")
    elif report.skipped and entry["outcome"] == "passed":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry.update(outcome="skipped", text=reason)


def write_report():
    """pytest_sessionfinish in a child: the outcomes, written whole (a temporary name, then renamed)."""
    temporary = REPORT + ".partial"
    with open(temporary, "w") as f:
        json.dump(_OUTCOMES, f)
    os.replace(temporary, REPORT)


def report_outcome(item, found):
    """In the main session, in place of the test's call: the outcome its child reported."""
    name = child_of(item)
    item.user_properties.append(("child_seconds", found["seconds"]))
    if found["outcome"] == "skipped":
        pytest.skip(found["text"])
    if found["outcome"] == "failed":
        pytest.fail(f"In the {name!r} child process:\n{found['text']}", pytrace=False)
