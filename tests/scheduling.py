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
}
# Timeouts (pytest-timeout, the test's own call; a shared fixture's processes have their own): a test marked
# slow gets SLOW_TIMEOUT unless it sets its own with @pytest.mark.timeout(seconds).
FAST_TIMEOUT, SLOW_TIMEOUT = 60, 300
# On the CI machine (CI=true), the fast tier (`-m "not slow"`) fails when it takes more than FAST_TIER_SECONDS
# or a test more than FAST_TEST_SECONDS in a phase (the setup that starts a shared fixture: its budget above;
# one that starts an environment's child: CHILD_SECONDS); the whole suite fails past SUITE_SECONDS. So the
# suite cannot grow back unnoticed.
FAST_TIER_SECONDS, FAST_TEST_SECONDS, CHILD_SECONDS, SUITE_SECONDS = 120, 10, 60, 600


def group_of(item):
    """The xdist group of a test: its environment's child, else the shared fixture it uses, else None."""
    name = environments.environment_of(item)
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
    order = ["digits_main_job", *(f"environment_{name}" for name in environments.ENVIRONMENTS), *SHARED_FIXTURES]
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

    def record(self, report):
        properties = dict(report.user_properties)
        seconds = properties.get("child_seconds", report.duration) if report.when == "call" else report.duration
        self.phases.append((report.nodeid, report.when, seconds, properties.get("group")))

    def overruns(self, config):
        """What went past its budget, as sentences: on the CI machine, for the suite or its fast tier as the
        README runs them (no paths or -k given)."""
        if os.environ.get("CI", "").lower() not in ("true", "1") or config.option.keyword:
            return []
        if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
            return []
        wall = time.monotonic() - self.start
        tier = config.option.markexpr
        found = []
        if tier == "not slow":
            if wall > FAST_TIER_SECONDS:
                found.append(f"the fast tier took {wall:.0f} s, more than {FAST_TIER_SECONDS} s")
            for nodeid, when, seconds, group in self.phases:
                budget = setup_budget(group) if when == "setup" else FAST_TEST_SECONDS
                if seconds > budget:
                    found.append(f"{nodeid} ({when}) took {seconds:.1f} s, more than its {budget} s")
        elif not tier and wall > SUITE_SECONDS:
            found.append(f"the suite took {wall:.0f} s, more than {SUITE_SECONDS} s")
        return found


BUDGETS = Budgets()
