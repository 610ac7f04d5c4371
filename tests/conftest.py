import contextlib
import importlib
import io
import os
import pathlib
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tests import environments, scheduling  # noqa: E402

# A child of tests/environments.py hides TensorFlow or splits the CPU before Keras is imported.
environments.prepare()

import pytest  # noqa: E402

# Keras (and with it TensorFlow) is imported by the fixtures and the test modules, not here: the xdist controller
# loads this file too, before it starts the workers, and runs no test.

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
    import keras

    keras.utils.set_random_seed(SEED)


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and restores float32 after it."""

    import keras

    def set_policy(name):
        keras.mixed_precision.set_global_policy(name)

    yield set_policy
    keras.mixed_precision.set_global_policy("float32")


ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_module(module, *args, timeout=900, stderr=False, quiet=True):
    """Runs `python -m module args...` from the repository root; returns its stdout (and its stderr with
    `stderr`). `quiet`: without TensorFlow's informational and warning lines from C++ (TF_CPP_MIN_LOG_LEVEL=2);
    False: what a user's terminal shows."""
    env = dict(os.environ)
    if quiet:
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    else:
        env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return (result.stdout, result.stderr) if stderr else result.stdout


def run_together(commands, timeout):
    """Starts every (argv, env) in `commands` from the repository root at once (stdout and stderr merged),
    waits for all, and returns their outputs once each has exited with 0; a process still running after
    `timeout` seconds is killed and fails the test."""
    processes = [
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for argv, env in commands
    ]
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return outputs


def tensorboard_scalars(folder):
    """{(run, tag, step): value} of every scalar in the event files of `folder`'s runs (its subfolders: "train",
    "validation"); each written once, or the test fails."""
    import tensorflow as tf

    found = {}
    for path in sorted(pathlib.Path(folder).glob("*/events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "scalars":
                    continue
                key = (path.parent.name, value.tag, event.step)
                assert key not in found, f"{key} written twice in {folder}"
                found[key] = tf.make_ndarray(value.tensor).item()
    return found


def run_command_line(module, *args, main=None, exit_code=0):
    """`python -m module args...` in this process: the job's flags defined and parsed from `args` as its command
    line does (`experiments.jobs.run_job`), then `main(flags)` (the job's own `main` by default), from the
    repository root; returns what it printed, once it exits with `exit_code`. The flags are removed again
    afterwards, so that the next command line defines them anew. A job's command line runs as a program once
    in the suite; its other tests come here.
    """
    from absl import flags

    from experiments import jobs

    job = importlib.import_module(module)
    before, argv, cwd = set(flags.FLAGS), sys.argv, os.getcwd()
    sys.argv = [f"{module.rsplit('.', 1)[-1]}.py", *args]
    printed = io.StringIO()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(printed):
            jobs.run_job(main or job.main, job.define_flags)
    except SystemExit as exit:
        if (exit.code or 0) != exit_code:
            raise
    else:
        assert exit_code == 0, f"{module} ended without the exit code {exit_code}"
    finally:
        sys.argv = argv
        os.chdir(cwd)
        for name in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, name)
    return printed.getvalue()


@pytest.fixture(scope="session")
def digits_main_job(tmp_path_factory):
    """The README's main command with its defaults and the user's logging, run once: (workdir, stdout,
    stderr)."""
    workdir = tmp_path_factory.mktemp("main_job") / "digits"
    return (workdir, *run_module("experiments.train", f"--workdir={workdir}", stderr=True, quiet=False))


@pytest.fixture(scope="session")
def digits_job(tmp_path_factory):
    """The training job, in this process, as a short run on the digits: a small model, 2 epochs, 4 steps per
    execution, the figures and two exports. For the tests of what the job writes and of the tools that read
    it (evaluation, TensorBoard): (workdir, config, metrics, the seconds of its phases and the job's)."""
    import time

    from experiments import jobs, train
    from tests.builders import tiny_digits_config

    config = tiny_digits_config(epochs=2)
    config.visualize_images = 2
    config.steps_per_execution = 4
    config.export = "saved_model,tflite"
    workdir = tmp_path_factory.mktemp("digits_job")
    phases, start = jobs.Phases(), time.perf_counter()
    metrics = train.train_and_evaluate(config, str(workdir), phases=phases)
    return workdir, config, metrics, (phases, time.perf_counter() - start)


@pytest.fixture(scope="session")
def two_replicas():
    """The training job's MirroredStrategy over the two logical CPUs of the two_cpus child, one for all of its
    tests: two MirroredStrategy objects in one process reuse each other's collective keys."""
    from keras_vit.distribute import get_strategy

    strategy = get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2, strategy.extended.worker_devices
    return strategy


# === Tests in a child process of their own (tests/environments.py) ===


@pytest.fixture(scope="session")
def environment_children(request, tmp_path_factory):
    """Starts each environment's child once, for all of its tests, when the first of them runs."""
    return environments.Children(request.session, tmp_path_factory.mktemp("environments"))


@pytest.fixture(autouse=True)
def environment(request):
    """For a test marked `environment(NAME)` in the main session: its outcome in NAME's child."""
    if environments.CURRENT is None and environments.environment_of(request.node) is not None:
        request.node.child_outcome = request.getfixturevalue("environment_children").outcome(request.node)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test that ran in its environment's child is not run again here: it reports the child's outcome."""
    found = getattr(pyfuncitem, "child_outcome", None)
    if found is None:
        return None
    environments.report_outcome(pyfuncitem, found)
    return True


# === Grouping, timeouts and time budgets (tests/scheduling.py) ===

pytest_collection_modifyitems = scheduling.pytest_collection_modifyitems
pytest_xdist_auto_num_workers = scheduling.pytest_xdist_auto_num_workers
SHARED_FIXTURES = scheduling.SHARED_FIXTURES


# === In a child of tests/environments.py: the outcomes for the main session; here, the time budgets ===


def pytest_runtest_logreport(report):
    if environments.CURRENT is not None:
        environments.record(report)
    else:
        scheduling.BUDGETS.record(report)


def pytest_configure(config):
    # On the CI machine, before the workers start: how fast this machine is, for the time budgets.
    if scheduling.checks_budgets(config):
        scheduling.BUDGETS.measure_machine()


def pytest_sessionstart(session):
    scheduling.BUDGETS.start = time.monotonic()


def pytest_collection_finish(session):
    """What the test modules' imports made (TensorFlow's, Keras' and the library's modules, functions and
    classes) lives as long as the process: moved out of reach of the garbage collector's full passes, which
    would otherwise walk it each time."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    if environments.CURRENT is not None:
        environments.write_report()
        return
    over = scheduling.BUDGETS.overruns(session.config)
    if over and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    scheduling.BUDGETS.over = over


def pytest_terminal_summary(terminalreporter):
    stretch = scheduling.BUDGETS.describe()
    if stretch:
        terminalreporter.write_line(stretch)
    for line in scheduling.BUDGETS.over:
        terminalreporter.write_line(f"TIME BUDGET: {line}", red=True)
