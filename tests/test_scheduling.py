"""The suite's own limits (tests/scheduling.py): timeouts for every test, the groups pytest-xdist keeps on one
worker, and the time budgets that fail the fast tier or the suite on the CI machine when they are passed."""

import types

import pytest

from tests import environments, scheduling


def config(markexpr="", keyword="", source=pytest.Config.ArgsSource.TESTPATHS):
    return types.SimpleNamespace(option=types.SimpleNamespace(markexpr=markexpr, keyword=keyword), args_source=source)


def report(nodeid, when, seconds, group=None, child_seconds=None):
    properties = [("group", group)] if group else []
    if child_seconds is not None:
        properties.append(("child_seconds", child_seconds))
    return types.SimpleNamespace(nodeid=nodeid, when=when, duration=seconds, user_properties=properties)


@pytest.fixture(autouse=True)
def main_session(monkeypatch):
    """The budgets are checked in the main session (the xdist controller): these tests may run in a worker."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def budgets(*reports, wall=0.0):
    found = scheduling.Budgets()
    found.start -= wall
    for one in reports:
        found.record(one)
    return found


def test_the_fast_tier_fails_past_its_wall_time_or_a_test_past_its_budget(monkeypatch):
    monkeypatch.setenv("CI", "true")
    tier = config("not slow")
    assert budgets(report("a", "call", 9.0), wall=100).overruns(tier) == []
    over = budgets(report("a", "call", 9.0), wall=scheduling.FAST_TIER_SECONDS + 1).overruns(tier)
    tier_limit = scheduling.FAST_TIER_SECONDS
    assert len(over) == 1 and over[0].startswith(f"the fast tier took {tier_limit + 1} s, more than {tier_limit} s")
    test_limit = scheduling.FAST_TEST_SECONDS
    assert budgets(report("tests/test_x.py::test_a", "call", test_limit - 0.5)).overruns(tier) == []
    (slow_call,) = budgets(report("tests/test_x.py::test_a", "call", test_limit + 0.5)).overruns(tier)
    assert slow_call == f"tests/test_x.py::test_a (call) took {test_limit + 0.5} s, more than its {test_limit} s"
    # The setup that starts a shared fixture or a child has the fixture's budget; in a child, the test's own time.
    assert budgets(report("b", "setup", 25.0, group="small_exports")).overruns(tier) == []
    assert budgets(report("b", "setup", 35.0, group="small_exports")).overruns(tier) != []
    assert budgets(report("c", "setup", 55.0, group="environment_jax")).overruns(tier) == []
    assert budgets(report("c", "call", 0.0, group="environment_jax", child_seconds=test_limit + 2)).overruns(tier) != []


def test_the_whole_suite_fails_past_its_wall_time_and_nothing_is_checked_off_ci_or_on_a_selection(monkeypatch):
    monkeypatch.setenv("CI", "true")
    (over,) = budgets(wall=scheduling.SUITE_SECONDS + 5).overruns(config())
    assert over.startswith(f"the suite took {scheduling.SUITE_SECONDS + 5} s, more than {scheduling.SUITE_SECONDS} s")
    slow = budgets(report("a", "call", 50.0), wall=scheduling.SUITE_SECONDS + 5)
    assert slow.overruns(config(keyword="jax")) == []  # -k: a selection, not the suite
    assert slow.overruns(config(source=pytest.Config.ArgsSource.ARGS)) == []  # paths given
    assert slow.overruns(config("slow")) == []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker's own session: the controller checks
    assert slow.overruns(config()) == []
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.delenv("CI")
    assert slow.overruns(config()) == [] and slow.overruns(config("not slow")) == []


class Item:
    """What the grouping reads of a collected test."""

    def __init__(self, nodeid, fixturenames=(), marks=()):
        self.nodeid, self.fixturenames, self.marks, self.user_properties = nodeid, list(fixturenames), list(marks), []

    def get_closest_marker(self, name):
        return next((mark for mark in reversed(self.marks) if mark.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark if hasattr(mark, "mark") else mark)


def test_every_test_gets_a_timeout_and_its_group_and_the_groups_come_first():
    items = [
        Item("plain"),
        Item("slow", marks=[pytest.mark.slow.mark]),
        Item("own", marks=[pytest.mark.slow.mark, pytest.mark.timeout(900).mark]),
        Item("child", ["tmp_path", "digits_model"], marks=[pytest.mark.environment("jax").mark]),
        Item("job", ["digits_main_job"]),
    ]
    scheduling.pytest_collection_modifyitems(None, items)
    assert [item.nodeid for item in items] == ["job", "child", "plain", "slow", "own"]
    timeouts = {item.nodeid: item.get_closest_marker("timeout").args[0] for item in items}
    assert timeouts == {"plain": 180, "slow": 300, "own": 900, "child": 300, "job": 180}
    assert items[1].get_closest_marker("slow")  # In a child: slow, whatever its own marks.
    groups = {item.nodeid: item.get_closest_marker("xdist_group") for item in items}
    assert groups["job"].args == ("digits_main_job",) and groups["child"].args == ("environment_jax",)
    assert groups["plain"] is None
    # A test of a child sets up nothing here: its fixtures are the child's.
    child = items[1]
    assert child.fixturenames == (["environment"] if environments.CURRENT is None else ["tmp_path", "digits_model"])
    with pytest.raises(pytest.UsageError, match=r"environment\('gpu'\); expected one of"):
        scheduling.pytest_collection_modifyitems(None, [Item("bad", marks=[pytest.mark.environment("gpu").mark])])


def test_the_budgets_stretch_on_a_slower_machine_up_to_a_limit(monkeypatch):
    monkeypatch.setenv("CI", "true")
    reference = scheduling.REFERENCE_SECONDS
    assert scheduling.machine_stretch(reference / 2) == 1.0  # A faster machine keeps the budgets as set.
    assert scheduling.machine_stretch(reference * 1.8) == pytest.approx(1.8)
    assert scheduling.machine_stretch(reference * 10) == scheduling.MAX_STRETCH
    # TensorFlow's kernels slower than the Python and NumPy part: the slower of the two sets the stretch.
    kernels = scheduling.TENSORFLOW_REFERENCE_SECONDS
    assert scheduling.machine_stretch(reference / 2, kernels * 1.7) == pytest.approx(1.7)
    assert scheduling.machine_stretch(reference * 1.2, kernels / 2) == pytest.approx(1.2)
    tier = config("not slow")
    test_limit = scheduling.FAST_TEST_SECONDS
    slower = budgets(report("tests/test_x.py::test_a", "call", test_limit * 1.5), wall=scheduling.FAST_TIER_SECONDS)
    slower.stretch = 1.8
    assert slower.overruns(tier) == []
    slower.phases.append(("tests/test_x.py::test_b", "call", test_limit * 1.85, None))
    took = f"{test_limit * 1.85:.1f} s"
    assert slower.overruns(tier) == [f"tests/test_x.py::test_b (call) took {took}, more than its {test_limit} s x1.80"]
    grown = budgets(wall=scheduling.SUITE_SECONDS * 1.9)
    grown.stretch = 1.8
    took, limit = round(scheduling.SUITE_SECONDS * 1.9), scheduling.SUITE_SECONDS
    assert grown.overruns(config()) == [f"the suite took {took} s, more than {limit} s x1.80"]
    grown.stretch = 1.0
    assert grown.overruns(config()) == [f"the suite took {took} s, more than {limit} s"]
    # The workloads themselves: fixed pieces of Python and float32 arithmetic, and of TensorFlow's kernels, that
    # take a measurable time.
    assert 0.0 < scheduling.reference_workload() < 60.0
    assert 0.0 < scheduling.tensorflow_workload() < 60.0


def test_an_environment_that_runs_in_anothers_child_is_grouped_with_it():
    onednn = Item("onednn", marks=[pytest.mark.environment("onednn_on").mark])
    replicas = Item("replicas", marks=[pytest.mark.environment("two_cpus").mark])
    scheduling.pytest_collection_modifyitems(None, [onednn, replicas])
    assert environments.RUN_IN["onednn_on"] == "two_cpus"
    assert {item.get_closest_marker("xdist_group").args for item in (onednn, replicas)} == {("environment_two_cpus",)}
    # That child sets the environment's own variables too.
    assert environments.ENVIRONMENTS["onednn_on"].items() <= environments.ENVIRONMENTS["two_cpus"].items()
    assert "onednn_on" not in environments.CHILDREN and "two_cpus" in environments.CHILDREN
    # And oneDNN off runs in the JAX child, which has it off.
    off = Item("off", marks=[pytest.mark.environment("onednn_off").mark])
    scheduling.pytest_collection_modifyitems(None, [off])
    assert off.get_closest_marker("xdist_group").args == ("environment_jax",)
    assert environments.ENVIRONMENTS["onednn_off"].items() <= environments.ENVIRONMENTS["jax"].items()
    assert environments.CHILDREN == ["two_cpus", "jax", "jax_without_tensorflow"]
