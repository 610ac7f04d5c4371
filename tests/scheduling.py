"""How the suite is spread over pytest-xdist's workers, and how long its tests may take.

Imported by tests/conftest.py, and light: neither Keras nor TensorFlow is imported here, so that a stand-in
session (tests/test_architecture.py) can use the same grouping in a second.
"""

import os
import time

import pytest

from tests import environments

# The fixtures that run once for several tests (a training job, a benchmark process) and the setup each may
# take in the fast tier, in seconds: under pytest-xdist (`-n`, set in setup.cfg) every test that uses one runs
# on the same worker, so the fixture still runs once. tests/test_architecture.py checks that every module- or
# session-scoped fixture is listed here.
SHARED_FIXTURES = {
    "digits_main_job": None,  # slow tier only
    "digits_job": None,
    "digits_model": None,
    "small_exports": 30,
    "tensorflow_runs": None,
    "jax_runs": None,
    "mirrored_runs": None,
    "two_replicas": None,
    "hybrid": 10,
    "timm_reference": 60,
    "torch_reference": 60,
    "failed_writes": 15,
    "small_saved_model": 15,
    "serving_exports": 30,  # two SavedModels of a small model
    "compiled_steps": None,  # the TPU compiler's tier (-m tpu_compile) only
    "deployed_service": 30,  # a tf.data service dispatcher and two worker processes (9-16 s here)
}
# Timeouts (pytest-timeout, the test's own call; a shared fixture's processes have their own): a test marked
# slow gets SLOW_TIMEOUT unless it sets its own with @pytest.mark.timeout(seconds).  They catch a hang, not a
# slow test (the budgets below do that). A test of under a second can wait here for 30 to 140 s, idle, about
# once per run on 2 cores: Python's garbage collector frees, inside it, a tf.data iterator an earlier test left
# behind, and the iterator's destructor waits for tf.data's autotuning thread, which can miss the cancellation's
# wake-up and sleep out its period, up to 60 s (keras_vit/data/pipeline.py's _from_memory: the library's in-memory
# pipelines run without it; the tests' own datasets and Keras' for arrays still have it). So a fast test gets 180 s.
FAST_TIMEOUT, SLOW_TIMEOUT = 180, 300
# On the CI machine (CI=true), the fast tier (`-m "not slow"`) fails when it takes more than FAST_TIER_SECONDS
# or a test more than FAST_TEST_SECONDS in a phase (the setup that starts a shared fixture: its budget above;
# one that starts an environment's child: CHILD_SECONDS); the whole suite fails past SUITE_SECONDS. So the
# suite cannot grow back unnoticed. The aims are 2 minutes for the fast tier and 10 for the suite; the limits
# sit well above what the two take today (under 3 and about 15 minutes on 2 cores), and come down as they do.
# A test's time depends on what runs beside it on the other worker (twice its time alone is common; the input
# benchmark's tests, 6 s alone and 3x that beside another, are slow for that); FAST_TEST_SECONDS leaves room.
FAST_TIER_SECONDS, FAST_TEST_SECONDS, CHILD_SECONDS, SUITE_SECONDS = 240, 15, 60, 1200
# The TPU compiler's tier (`-m tpu_compile`, its own environment in .ci/run) fails past this.
TPU_COMPILE_TIER_SECONDS = 180
# The budgets are seconds of the machine they were set on (2 cores of an AVX-512 Xeon), where `reference_workload`
# takes REFERENCE_SECONDS and `tensorflow_workload` TENSORFLOW_REFERENCE_SECONDS. On a slower machine (the same
# suite took 1.8x as long on another CI machine of the same size) they stretch by how much longer the slower of the
# two takes there, up to MAX_STRETCH: a slower machine does not fail the suite, a suite that grew does.
# The TensorFlow part is there because Python and NumPy do not see TensorFlow's CPU kernels, where most of the
# suite's time goes: on a 2-core AMD EPYC with AVX2 only (TensorFlow's oneDNN off) the reference workload took
# 0.31 s (faster than the budgets' machine) while the fast tier of the same commit (5949b32) took 333 s there
# against 188 s on the budgets' machine (1.77x). TENSORFLOW_REFERENCE_SECONDS is what `tensorflow_workload` took
# on that EPYC (0.42 to 0.49 s, TensorFlow 2.20 and 2.21 alike; 0.45) divided by 1.77: measured there, scaled by
# what the suite measured on both.
REFERENCE_SECONDS, TENSORFLOW_REFERENCE_SECONDS, MAX_STRETCH = 0.45, 0.45 / 1.77, 2.5


def reference_workload():
    """Seconds of a fixed piece of the work the suite does on the CPU, the best of three runs: Python (tracing
    Keras and TensorFlow functions is Python) and float32 matrix products (the models' arithmetic)."""
    import numpy as np

    matrix = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)

    def once():
        start = time.perf_counter()
        table = {}
        for i in range(1_200_000):
            table[i % 1009] = table.get(i % 1009, 0) + i
        product = matrix
        for _ in range(240):
            product = np.tanh(product @ matrix * 0.01)
        return time.perf_counter() - start

    return min(once() for _ in range(3))


def tensorflow_workload():
    """Seconds of TensorFlow's CPU kernels on a training step of two small transformer blocks and a patch
    convolution (a traced tf.function, its gradient included), the best of three runs of 4 steps; None where
    TensorFlow is not installed."""
    try:
        import tensorflow as tf
    except ImportError:
        return None
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = tf.constant(rng.standard_normal((16, 65, 192), dtype=np.float32))
    images = tf.constant(rng.standard_normal((16, 32, 32, 3), dtype=np.float32))
    shapes = [(192, 576), (192, 192), (192, 768), (768, 192), (4, 4, 3, 192)]
    weights = [tf.Variable(rng.standard_normal(shape, dtype=np.float32) * 0.05) for shape in shapes]

    @tf.function
    def step():
        qkv, out, up, down, patch = weights
        with tf.GradientTape() as tape:
            h = tokens + tf.reduce_mean(tf.nn.conv2d(images, patch, 4, "VALID"))
            for _ in range(2):
                normed = tf.nn.l2_normalize(h - tf.reduce_mean(h, -1, keepdims=True), -1)
                q, k, v = tf.split(tf.einsum("bnd,de->bne", normed, qkv), 3, -1)
                attention = tf.nn.softmax(tf.einsum("bqd,bkd->bqk", q, k) / 13.9)
                h = h + tf.einsum("bqk,bkd->bqd", attention, v) @ out
                h = h + tf.nn.gelu(h @ up) @ down
            loss = tf.reduce_mean(h**2)
        return tape.gradient(loss, weights)

    step()  # traced once, not timed

    def once():
        start = time.perf_counter()
        for _ in range(4):
            gradients = step()
        gradients[0].numpy()
        return time.perf_counter() - start

    return min(once() for _ in range(3))


def machine_stretch(seconds=None, tensorflow_seconds=None):
    """How many times longer than on the budgets' machine this one takes (the slower of the two workloads'
    ratios): 1 to MAX_STRETCH."""
    seconds = reference_workload() if seconds is None else seconds
    ratio = seconds / REFERENCE_SECONDS
    if tensorflow_seconds is not None:
        ratio = max(ratio, tensorflow_seconds / TENSORFLOW_REFERENCE_SECONDS)
    return min(MAX_STRETCH, max(1.0, ratio))


def group_of(item):
    """The xdist group of a test: its environment's child, else the shared fixture it uses, else None."""
    name = environments.child_of(item)
    if name:
        return f"environment_{name}"
    shared = [name for name in SHARED_FIXTURES if name in item.fixturenames]
    return shared[0] if shared else None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Marks the tests that share a fixture or a child with their group and gives every test its timeout;
    runs the groups first, the main job's (the longest piece of the suite) at the head, then the children:
    one worker starts the job while the others take the rest. A test in a child is slow: the child's start
    alone takes seconds."""
    order = ["digits_main_job", *(f"environment_{name}" for name in environments.CHILDREN), *SHARED_FIXTURES]
    rank = {}
    for item in items:
        group = group_of(item)
        if group and group.startswith("environment_"):
            item.add_marker(pytest.mark.slow)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            item.user_properties.append(("group", group))  # for the budgets, in the reports
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT if item.get_closest_marker("slow") else FAST_TIMEOUT))
        rank[item.nodeid] = order.index(group) if group else len(order)
        if environments.CURRENT is None and group and group.startswith("environment_"):
            # Its fixtures are set up in the child, where it runs; here it only reports the child's outcome.
            item.fixturenames = ["environment"]
    items.sort(key=lambda item: rank[item.nodeid])


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin (`-p no:xdist`), not called
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (each worker holds its own TensorFlow and models)."""
    return max(1, min(4, os.cpu_count() or 1))


def setup_budget(group):
    """The seconds the setup of a test in `group` may take in the fast tier (it may start the group's fixture)."""
    if group is None:
        return FAST_TEST_SECONDS
    if group.startswith("environment_"):
        return CHILD_SECONDS
    return SHARED_FIXTURES[group] or FAST_TEST_SECONDS


class Budgets:
    """The time each test took, phase by phase, as the main session (the xdist controller) receives it."""

    def __init__(self):
        self.start, self.phases, self.over = time.monotonic(), [], []
        # set by `measure_machine` on the CI machine
        self.stretch, self.workload, self.tensorflow_workload = 1.0, None, None

    def measure_machine(self):
        """Times the reference workloads on this machine (before the workers start) and stretches the budgets."""
        self.workload, self.tensorflow_workload = reference_workload(), tensorflow_workload()
        self.stretch = machine_stretch(self.workload, self.tensorflow_workload)

    def describe(self):
        """The line the terminal summary prints about the budgets in force."""
        if self.workload is None:
            return None
        tensorflow = "" if self.tensorflow_workload is None else (
            f" and TensorFlow's {self.tensorflow_workload:.2f} s ({TENSORFLOW_REFERENCE_SECONDS:.2f} s)")
        return (f"time budgets x{self.stretch:.2f}: the reference workload took {self.workload:.2f} s here "
                f"({REFERENCE_SECONDS:.2f} s on the machine the budgets were set on){tensorflow}")

    def record(self, report):
        properties = dict(report.user_properties)
        seconds = properties.get("child_seconds", report.duration) if report.when == "call" else report.duration
        self.phases.append((report.nodeid, report.when, seconds, properties.get("group")))

    def overruns(self, config):
        """What went past its budget, as sentences: on the CI machine, for the suite or its fast tier as the
        README runs them (no paths or -k given)."""
        if not checks_budgets(config):
            return []
        wall = time.monotonic() - self.start
        tier = config.option.markexpr
        found = []

        def budget(seconds):
            return f"{seconds:.0f} s" if self.stretch == 1.0 else f"{seconds:.0f} s x{self.stretch:.2f}"

        if tier == "not slow":
            if wall > FAST_TIER_SECONDS * self.stretch:
                found.append(f"the fast tier took {wall:.0f} s, more than {budget(FAST_TIER_SECONDS)}")
            for nodeid, when, seconds, group in self.phases:
                limit = setup_budget(group) if when == "setup" else FAST_TEST_SECONDS
                if seconds > limit * self.stretch:
                    found.append(f"{nodeid} ({when}) took {seconds:.1f} s, more than its {budget(limit)}")
        elif tier == "tpu_compile" and wall > TPU_COMPILE_TIER_SECONDS * self.stretch:
            found.append(f"the TPU compiler's tier took {wall:.0f} s, more than {budget(TPU_COMPILE_TIER_SECONDS)}")
        elif not tier and wall > SUITE_SECONDS * self.stretch:
            found.append(f"the suite took {wall:.0f} s, more than {budget(SUITE_SECONDS)}")
        return found


def checks_budgets(config):
    """Whether the budgets apply to this session: on the CI machine (CI=true), for the suite or its fast tier as
    the README runs them (no paths or -k given), in the main session (the xdist controller)."""
    if os.environ.get("CI", "").lower() not in ("true", "1") or config.option.keyword:
        return False
    if os.environ.get("PYTEST_XDIST_WORKER") or environments.CURRENT is not None:
        return False
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS


BUDGETS = Budgets()
