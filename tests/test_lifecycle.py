"""A training run's life: stopped by SIGTERM or SIGINT with its state saved, resumed at the exact step with the
uninterrupted run's data and weights, never silently overwritten once finished, and told what went wrong without
a traceback."""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_vit import backups, callbacks
from keras_vit import data as vit_data
from keras_vit.callbacks import Backup, StopOnSignal, StoppedBySignal
from tests.builders import prepare_tfds, small_vit, write_folder, write_odd_folder
from tests.conftest import ROOT, run_command_line, run_together, tensorboard_scalars

# === The data: a function of the position in the stream ===


def small_split(n=20):
    rng = np.random.default_rng(0)
    return vit_data.Split(rng.integers(0, 256, (n, 6, 6, 3), dtype=np.uint8), np.arange(n, dtype=np.int32) % 4)


def batches(stream, count):
    return [tuple(np.asarray(t) for t in batch) for batch in stream.take(count)]


def test_a_stream_started_at_a_step_gives_the_batches_the_whole_stream_gives_there():
    split = small_split()  # 20 examples, batches of 8: 2 batches (16 examples) an epoch.
    whole = batches(vit_data.training_stream(split, 8, num_classes=4, seed=3, max_shift=1), 7)
    resumed = batches(vit_data.training_stream(split, 8, num_classes=4, seed=3, max_shift=1, start_step=3), 4)
    for a, b in zip(whole[3:], resumed, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    # Each epoch draws 16 distinct examples of the 20, another 16 in the next epoch.
    labels = [np.concatenate([whole[2 * e][1], whole[2 * e + 1][1]]) for e in range(3)]
    assert all(len(epoch) == 16 for epoch in labels)
    plain = batches(vit_data.training_stream(split, 8, seed=3), 4)
    first, second = (np.concatenate([plain[i][0], plain[i + 1][0]]).reshape(16, -1) for i in (0, 2))
    assert len({row.tobytes() for row in first}) == 16 and not np.array_equal(first, second)
    with pytest.raises(ValueError, match=r"`batch_size` must be in \[1, 20\].*Received: batch_size=21"):
        vit_data.training_stream(split, 21)


def test_the_in_memory_pipelines_run_without_the_autotuner_and_split_by_example():
    """The training stream and the evaluation batches of an in-memory split start no tf.data autotuning thread
    (keras_vit/data/pipeline.py's _from_memory says why: deleting a long-lived iterator could wait for that
    thread's sleep), and remain split by example across workers; their batches are as deterministic as before
    (the stream's test above)."""
    split = small_split()
    made = {
        "training stream": vit_data.training_stream(split, 8, num_classes=4, max_shift=1),
        "training batches": vit_data.make_pipeline(split, 8, training=True, max_shift=1),
        "evaluation batches": vit_data.make_pipeline(split, 8, training=False, num_classes=4),
    }
    for name, ds in made.items():
        options = ds.options()
        assert options.autotune.enabled is False, name
        assert options.experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.DATA, name
        assert len(batches(ds, 2)) == 2, name


# The cached and TFDS forms (5-7 s each on 2 cores) in the full suite only; the fast tier keeps the folder's.
@pytest.mark.parametrize("kind", ["folder", pytest.param("cached folder", marks=pytest.mark.slow),
                                  pytest.param("tfds", marks=pytest.mark.slow)])
def test_an_image_pipeline_started_where_it_was_gives_the_batches_the_whole_one_gives_there(tmp_path, kind):
    """The training pipeline of an image folder (read as listed, or its bytes kept) or a TFDS set, with bad
    files among the good: started again at the position recorded after step k, it gives the batches the
    uninterrupted pipeline gave after step k, across the end of a pass, crops and all; two replicas fed by one
    pipeline make one step of two batches."""
    good, bad = write_odd_folder(tmp_path / "odd")
    if kind == "tfds":
        train = [(good[p][2], p) for p in sorted(good)] + [(i % 2, p) for i, p in enumerate(sorted(bad)[:3])]
        source = vit_data.load_tfds("tiny_colours", data_dir=prepare_tfds(tmp_path, {"train": train,
                                                                                     "test": train[:2]}, 2))
    else:
        source = vit_data.load_folder(tmp_path / "odd")
    context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)
    options = dict(seed=5, cache=kind == "cached folder", shuffle_buffer=4)

    def pipeline(positions):
        return vit_data.training_pipeline(source, 16, 6, context, positions=positions, **options)

    recorded = vit_data.InputPositions()
    whole = batches(pipeline(recorded), 12)  # 6 steps of 2 batches of 3: more than a pass of good images
    assert 6 * 6 > len(good)
    for k in (1, 3, 4):
        start = recorded.after(k)
        assert start is not None and start["0"][1] <= source.num_train
        resumed = batches(pipeline(vit_data.InputPositions(k, json.loads(json.dumps(start)))), 12 - 2 * k)
        for a, b in zip(whole[2 * k:], resumed, strict=True):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
    assert recorded.after(7) is None and recorded.after(6) is not None
    # Each pass in a new order: the labels of the first pass's images are not the second pass's.
    again = batches(pipeline(vit_data.InputPositions(0, {"0": [1, 0]})), 2)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(whole[:2], again))


# === The library: a signal, a backup at the step, the exact resume ===


class SignalAt(keras.callbacks.Callback):
    """Sends `number` to this process once `backup.step` reaches `step` (before the callbacks after it run)."""

    def __init__(self, backup, step, number=signal.SIGTERM):
        super().__init__()
        self.backup, self.step, self.number = backup, step, number

    def on_train_batch_end(self, batch, logs=None):
        if self.backup.step == self.step - 1:  # The backup counts this batch after this callback.
            os.kill(os.getpid(), self.number)


def compiled_vit():
    """The small model for the 6 px images of `small_split` (2 x 2 patches, 4 classes) with dropout and stochastic
    depth, compiled, its optimizer built."""
    keras.utils.set_random_seed(1)
    model = small_vit(image_size=6, patch_size=3, num_classes=4, dropout_rate=0.2, stochastic_depth_rate=0.1)
    model.compile(keras.optimizers.AdamW(1e-2), keras.losses.CategoricalCrossentropy(from_logits=True),
                  jit_compile=False)  # fmt: skip
    model.optimizer.build(model.trainable_variables)
    return model


def fit_from(model, folder, step, extra=(), epochs=3):
    """`fit` from `step` with a backup every 4 steps and the stop on a signal: (backup, stop, the
    `StoppedBySignal` that ended it or None)."""
    backup = Backup(folder, save_freq=4)
    backup.start_step = step
    stop = StopOnSignal(backup, grace_seconds=60)
    stream = vit_data.training_stream(small_split(), 8, num_classes=4, seed=5, max_shift=1, start_step=step)
    try:
        model.fit(stream, epochs=epochs, initial_epoch=step // 2, steps_per_epoch=2, verbose=0, shuffle=False,
                  callbacks=[*(c(backup) for c in extra), backup, stop])  # fmt: skip
    except StoppedBySignal as stopped:
        return backup, stop, stopped
    return backup, stop, None


# SIGINT in the full suite only; the fast tier keeps SIGTERM, a preempted VM's.
@pytest.mark.parametrize("number", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_stops_fit_after_the_step_with_a_backup_and_a_resumed_run_ends_as_the_whole_one(tmp_path, number):
    check_signal_and_resume(tmp_path, number)


@pytest.mark.environment("jax")
def test_on_jax_a_signal_stops_fit_with_a_backup_and_the_resumed_run_ends_as_the_whole_one(tmp_path):
    assert keras.backend.backend() == "jax"
    check_signal_and_resume(tmp_path, signal.SIGTERM)


def check_signal_and_resume(tmp_path, number):
    """Three fits of a small ViT with dropout and stochastic depth: whole; stopped by `number` at step 3 (mid
    epoch); resumed from its backup. The resumed one ends with the whole one's weights, bit for bit."""
    whole = compiled_vit()
    assert fit_from(whole, str(tmp_path / "whole"), 0)[2] is None
    assert int(whole.optimizer.iterations.numpy()) == 6 and not (tmp_path / "whole").exists()  # Done: removed.

    handlers = {n: signal.getsignal(n) for n in (signal.SIGTERM, signal.SIGINT)}
    stopped = compiled_vit()
    backup, stop, raised = fit_from(stopped, str(tmp_path / "run"), 0, [lambda b: SignalAt(b, 3, number)])
    assert stop.signal_number == number and stop.exit_code() == 128 + number
    assert raised.code == 128 + number and raised.backup_path == stop.backup_path and raised.step == 3
    assert int(stopped.optimizer.iterations.numpy()) == 3  # Mid-epoch: the second epoch's first step.
    with open(stop.backup_path) as f:
        assert json.load(f)["step"] == 3
    assert {n: signal.getsignal(n) for n in handlers} == handlers  # The handlers are back.

    resumed = compiled_vit()
    epoch, step = backups.restore_position(resumed, str(tmp_path / "run"))
    assert (epoch, step) == (1, 3)

    class StopAtEnd(keras.callbacks.Callback):
        def __init__(self, backup):
            super().__init__()
            self.backup = backup

        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = self.backup.step + 1 >= 6

    fit_from(resumed, str(tmp_path / "run"), step, [StopAtEnd])
    assert int(resumed.optimizer.iterations.numpy()) == 6
    for a, b in zip(whole.weights, resumed.weights, strict=True):  # Dropout's generators included.
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_a_signal_ends_fit_at_once_without_validating_though_the_validation_outlasts_the_grace_period(tmp_path):
    """SIGTERM mid-epoch, with a validation split that takes 3 s and a grace period of 2 s: `fit` ends after the
    step in flight and its backup, by `StoppedBySignal` (exit status 143), and neither validates nor ends the
    epoch (had it validated, the grace period would have run out and the process would have been ended)."""
    validated, ended = [], []

    def slow(images, labels):
        def wait():
            validated.append(time.monotonic())
            time.sleep(1.0)
            return np.float32(0)

        return images + tf.numpy_function(wait, [], tf.float32), labels

    split = small_split(24)
    validation = tf.data.Dataset.from_tensor_slices(
        (split.images.astype(np.float32), tf.one_hot(split.labels, 4))).batch(8).map(slow)  # fmt: skip
    model = compiled_vit()
    backup = Backup(str(tmp_path / "run"), save_freq=100)
    stop = StopOnSignal(backup, grace_seconds=2)
    epoch_end = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: ended.append(epoch))
    start = time.monotonic()
    with pytest.raises(StoppedBySignal) as stopped:
        model.fit(vit_data.training_stream(split, 8, num_classes=4), epochs=2, steps_per_epoch=3, verbose=0,
                  validation_data=validation, callbacks=[SignalAt(backup, 2), backup, stop, epoch_end])  # fmt: skip
    assert stopped.value.code == 143 and stopped.value.step == 2 and stop.exit_code() == 143
    assert time.monotonic() - start < stop.grace_seconds + 10 and not validated and not ended
    with open(stopped.value.backup_path) as f:
        assert json.load(f)["step"] == 2
    assert signal.getsignal(signal.SIGTERM) is not stop._caught  # The handlers are back.


class SignalAfterStep(keras.callbacks.Callback):
    """Sends SIGTERM to this process once the optimizer has taken `step` steps."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_the_job_on_an_image_folder_stopped_mid_epoch_resumes_with_the_uninterrupted_runs_data(tmp_path):
    """The training job on an image folder (a bad file among the images, random crops, flips and RandAugment,
    dropout): stopped by SIGTERM mid-epoch, then run again, it ends with the weights of the uninterrupted run,
    bit for bit: the input read on from the position its backup saved."""
    from experiments import jobs, train
    from experiments.configs import digits

    root = write_folder(tmp_path / "images", per_class=6, size=(20, 16), corrupt=("cat/bad.jpg",))
    config = digits.get_config()
    config.dataset, config.image_size, config.batch_size, config.epochs = f"folder:{root}", 16, 2, 2
    config.model.update(patch_size=8, num_layers=1, hidden_dim=16, num_heads=2, mlp_dim=32)
    config.augment.randaugment, config.visualize, config.tensorboard_figures = (2, 5), False, 0
    config.jit_compile, config.backup_every = "off", "2"
    train.train_and_evaluate(config, str(tmp_path / "whole"))
    with pytest.raises(jobs.Stopped, match="Stopped by SIGTERM at step 5 of 12"):  # 6 steps an epoch
        train.train_and_evaluate(config, str(tmp_path / "run"), callbacks=[SignalAfterStep(4)])
    with open(max((tmp_path / "run" / "backup").glob("state-*.json"))) as f:
        saved = json.load(f)
    assert saved["step"] == 5 and list(saved["input"]) == ["0"]
    train.train_and_evaluate(config, str(tmp_path / "run"))
    models = [keras.models.load_model(tmp_path / name / "model.keras") for name in ("whole", "run")]
    steps = [int(m.optimizer.iterations.numpy()) for m in models]
    assert steps == [12, 12]
    for a, b in zip(models[0].weights, models[1].weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


JAX_PROCESS = """
import json, os, signal, sys
import keras
import numpy as np
keras.distribution.initialize()  # Two processes, from KERAS_DISTRIBUTION_*.
import jax
import keras_vit
from keras_vit import backups, data as vit_data
from keras_vit.callbacks import Backup, StopOnSignal, StoppedBySignal, any_process

mode, folder = sys.argv[1], sys.argv[2]
keras.distribution.set_distribution(keras.distribution.DataParallel())  # One device per process: two in all.
keras.utils.set_random_seed(1)
model = keras_vit.build_vit("testing", image_size=6, num_classes=4, patch_size=3, dropout_rate=0.2,
                            stochastic_depth_rate=0.1, head_kernel_initializer="glorot_uniform")
model.compile(keras.optimizers.AdamW(1e-2), keras.losses.CategoricalCrossentropy(from_logits=True))
model.optimizer.build(model.trainable_variables)
step = backups.restore_position(model, folder)[1] if mode == "resume" else 0
backup = Backup(folder, save_freq=4)
backup.start_step = step
stop = StopOnSignal(backup, grace_seconds=60, workers=jax.process_count(), agree=any_process())


class SignalAt(keras.callbacks.Callback):  # Process 1 alone: SIGTERM at the end of step 3.
    def on_train_batch_end(self, batch, logs=None):
        if mode == "signal" and jax.process_index() == 1 and backup.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        self.model.stop_training = self.model.stop_training or backup.step + 1 >= 6  # 6 steps in all


rng = np.random.default_rng(0)
split = vit_data.Split(rng.integers(0, 256, (20, 6, 6, 3), dtype=np.uint8), np.arange(20, dtype=np.int32) % 4)
stream = vit_data.training_stream(split, 8, num_classes=4, seed=5, max_shift=1, start_step=step)
try:
    model.fit(stream, epochs=3, initial_epoch=step // 2, steps_per_epoch=2, verbose=0, shuffle=False,
              callbacks=[SignalAt(), backup, stop])
except StoppedBySignal:
    pass  # stop.signal_number says so
np.savez(folder + ".npz", *[keras.ops.convert_to_numpy(w) for w in model.weights])
print("RESULT " + json.dumps({"signal": stop.signal_number, "step": backup.step,
                              "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations))}))
"""


def run_jax_processes(mode, folder):
    """Two JAX processes on 127.0.0.1 with a data-parallel `keras.distribution` across them, each fitting
    the model with a backup in `folder`-INDEX: their RESULT lines."""
    from tests.builders import free_ports

    addresses = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    commands = []
    for index in range(2):
        env = dict(os.environ, KERAS_BACKEND="jax", KERAS_DISTRIBUTION_JOB_ADDRESSES=addresses,
                   KERAS_DISTRIBUTION_NUM_PROCESSES="2", KERAS_DISTRIBUTION_PROCESS_ID=str(index),
                   TF_CPP_MIN_LOG_LEVEL="2")  # fmt: skip
        env.pop("XLA_FLAGS", None)
        commands.append(([sys.executable, "-c", JAX_PROCESS, mode, f"{folder}-{index}"], env))
    outputs = run_together(commands, timeout=300)
    assert all("RESULT " in output for output in outputs), [output[-3000:] for output in outputs]
    return [json.loads(output.split("RESULT ", 1)[1].splitlines()[0]) for output in outputs]


@pytest.mark.slow
def test_two_jax_processes_stop_together_on_one_sigterm_and_resume_as_the_whole_run(tmp_path):
    """Keras' JAX backend, two processes with data parallelism across them: process 1 alone gets SIGTERM
    at step 3; both stop after that step with a backup each (`any_process`, one gather a step). Resumed,
    both end with the weights of the uninterrupted two-process run, bit for bit."""
    whole = run_jax_processes("whole", tmp_path / "whole")
    assert [(r["signal"], r["iterations"]) for r in whole] == [(None, 6), (None, 6)]
    stopped = run_jax_processes("signal", tmp_path / "run")
    assert [(r["signal"], r["step"], r["iterations"]) for r in stopped] == [(signal.SIGTERM, 3, 3)] * 2
    resumed = run_jax_processes("resume", tmp_path / "run")
    assert [r["iterations"] for r in resumed] == [6, 6]
    for index in range(2):
        expected, got = (np.load(tmp_path / f"{name}-{index}.npz") for name in ("whole", "run"))
        for key in expected:
            np.testing.assert_array_equal(expected[key], got[key], err_msg=f"process {index}: {key}")


def test_a_fit_stopped_early_keeps_its_backup(tmp_path):
    model = compiled_vit()
    backup = Backup(str(tmp_path / "run"), save_freq=100)
    model.fit(vit_data.training_stream(small_split(), 8, num_classes=4), epochs=3, steps_per_epoch=2, verbose=0,
              callbacks=[backup, StopEarly(backup, at=3)])  # fmt: skip
    assert backup.step == 3 and backups.restore_position(compiled_vit(), str(tmp_path / "run")) == (1, 3)


def test_backups_every_few_seconds_of_training_count_the_runs_steps(tmp_path, monkeypatch):
    import types

    clock = iter(range(0, 10_000, 7))  # Seconds: 7 s pass between two reads of the Backup's clock.
    monkeypatch.setattr(callbacks.state, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    model = compiled_vit()
    backup = Backup(str(tmp_path / "run"), save_freq=100, keep=10, save_seconds=20)
    model.fit(vit_data.training_stream(small_split(), 8, num_classes=4), epochs=1, steps_per_epoch=6, verbose=0,
              callbacks=[backup, StopEarly(backup, at=5)])  # fmt: skip
    steps = sorted(json.loads(path.read_text())["step"] for path in (tmp_path / "run").glob("state-*.json"))
    assert steps == [3, 5], steps  # 21 s after the start, at step 3; then at the stop.


class StopEarly(keras.callbacks.Callback):
    """Saves a backup and stops `fit` at step `at`, as a stop on NaN after a backup would: the backup is kept."""

    def __init__(self, backup, at=2):
        super().__init__()
        self.backup, self.at = backup, at

    def on_train_batch_end(self, batch, logs=None):
        if self.backup.step == self.at:
            self.backup.save()
            self.model.stop_training = True


# === The job: a finished run, user errors, --help ===


def test_a_finished_run_is_not_trained_over_without_overwrite(tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.json").write_text(json.dumps({"test_accuracy": 0.9944}))
    run_command_line("experiments.train", f"--workdir={workdir}", exit_code=2)
    error = capsys.readouterr().err
    assert f"{workdir} holds a finished run (test_accuracy 0.9944)" in error and "--overwrite" in error
    assert "Traceback" not in error
    assert (workdir / "metrics.json").exists()


@pytest.mark.parametrize("arguments, message", [
    (["--config.epoch=5"], r'Did you mean "epochs" instead of "epoch"'),
    (["--config.precision=bf16"], r"config.precision must be a Keras dtype policy.*'bf16'"),
    (["--dataset=folder:x"], r"Unknown flag --dataset. The config field is set with --config.dataset=VALUE"),
    (["--config.dataset=digit"], r"config.dataset must be 'digits', 'tfds:NAME\[:SPLIT\]' or 'folder:PATH'"),
])  # fmt: skip
def test_user_errors_are_one_message_and_exit_2(tmp_path, capsys, arguments, message):
    import re

    run_command_line("experiments.train", f"--workdir={tmp_path / 'run'}", *arguments, exit_code=2)
    error = capsys.readouterr().err
    assert re.search(message, error), error
    assert "Traceback" not in error and not (tmp_path / "run").exists()


def test_help_lists_the_config_fields_and_exits_0():
    printed = run_command_line("experiments.train", "--help", exit_code=0)
    assert "--workdir" in printed and "--overwrite" in printed
    assert "    --config.epochs=60" in printed and "--config.model.variant='Ti/2'" in printed
    assert "--config.grace_seconds=30.0" in printed and "--[no]profile_phases" in printed
    from experiments import jobs

    # --profile_phases counts the imports from the process's start.
    assert 0 < jobs.process_seconds() < time.monotonic() + 1


# === The command: SIGTERM mid-epoch, the rerun resumes and ends as the uninterrupted run ===

# With the moving average of the weights: Keras' fit puts it in the model when it returns, and the resumed run's
# first fit (the rest of the stopped epoch) is followed by another.
TINY = ["--config.epochs=2", "--config.jit_compile=off", "--config.backup_every=4", "--config.visualize=false",
        "--config.ema_momentum=0.9",
        "--config.tensorboard_figures=0", "--config.model.num_layers=1", "--config.model.hidden_dim=16",
        "--config.model.mlp_dim=32", "--config.model.num_heads=2"]  # fmt: skip


def command(workdir):
    return [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *TINY]


# The command, with a teardown after the stop that does not end (as an input iterator's deletion that waits on
# tf.data's autotuning thread, or a remote file system that hangs).
STALLING = """
import time
from experiments import jobs, train
from keras_vit import callbacks

callbacks.RunCallbacks.end = lambda self: time.sleep(600)
jobs.run_job(train.main, train.define_flags)
"""


@pytest.mark.slow
def test_a_stopped_command_whose_teardown_stalls_exits_at_the_end_of_the_grace_period(tmp_path):
    """After the backup, the command's grace period still holds: a teardown that does not end is cut at it, with
    the signal's status and a message that the backup is written, which the next run resumes from."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    run = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-c", STALLING, f"--workdir={run}", *TINY, "--config.grace_seconds=6"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    first_backup = run / "backup" / "state-00000000.json"
    deadline = time.monotonic() + 600
    while not first_backup.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    sent = time.monotonic()
    job.send_signal(signal.SIGTERM)
    try:
        _, stderr = job.communicate(timeout=120)
    finally:
        job.kill()  # Only if it is still there: the stall would hold it 600 s.
    waited = time.monotonic() - sent
    assert job.returncode == 143, stderr[-3000:]
    assert 5 < waited < 20, waited  # The 6 s deadline, not the 600 s teardown.
    step = int(stderr.split("the backup of step ")[1].split()[0])
    assert "but the process had not exited 6 s after the signal; it exits now" in stderr, stderr[-3000:]
    record = json.loads((run / "backup" / sorted(p.name for p in (run / "backup").glob("state-*.json"))[-1])
                        .read_text())  # fmt: skip
    assert record["step"] == step and step >= 4


@pytest.mark.slow
def test_sigterm_mid_epoch_then_the_same_command_ends_as_the_uninterrupted_run(tmp_path):
    """The command stopped by SIGTERM mid-epoch exits with 143 within the grace period without validating the
    stopped epoch; run again, it finishes that epoch, then runs the uninterrupted run's epochs: its log.csv,
    history.json, TensorBoard scalars, best epoch and weights are the uninterrupted run's, bit for bit, and its
    progress says where it resumed."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    whole = subprocess.run(command(tmp_path / "whole"), cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]

    run = tmp_path / "run"
    job = subprocess.Popen(command(run), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_backup = run / "backup" / "state-00000000.json"  # Step 4 of 20 in the first epoch.
    deadline = time.monotonic() + 600
    while not first_backup.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    sent = time.monotonic()
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 143, stderr[-3000:]
    assert time.monotonic() - sent < 30  # Within the default grace period.
    assert "Stopped by SIGTERM at step" in stderr and "Run the same command to resume" in stderr
    stopped_at = int(stderr.split("Stopped by SIGTERM at step ")[1].split()[0])
    assert 4 <= stopped_at < 40 and "Traceback" not in stderr
    # The stopped epoch was neither validated nor logged: log.csv holds the epochs that ended before it.
    logged = (run / "log.csv").read_text().splitlines()[1:] if (run / "log.csv").exists() else []
    assert [line.split(",")[0] for line in logged] == [str(e) for e in range(stopped_at // 20)]

    resumed = subprocess.run(command(run), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stopped_at} of 40" in resumed.stderr  # The resume says where it starts.
    if stopped_at % 20:
        epoch, step = divmod(stopped_at, 20)
        assert f"Epoch {epoch + 1}/2: resumed at step {step} of 20" in resumed.stdout, resumed.stdout[-2000:]
    models = [keras.models.load_model(path / name) for name in ("model.keras", "best.keras")
              for path in (tmp_path / "whole", run)]  # fmt: skip
    assert [int(m.optimizer.iterations.numpy()) for m in models[:2]] == [40, 40]
    for first, second in (models[:2], models[2:]):
        for a, b in zip(first.weights, second.weights, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    for name in ("log.csv", "history.json"):
        assert (run / name).read_text() == (tmp_path / "whole" / name).read_text(), name
    assert [line.split(",")[0] for line in (run / "log.csv").read_text().splitlines()[1:]] == ["0", "1"]
    scalars = tensorboard_scalars(run / "tensorboard")
    uninterrupted = tensorboard_scalars(tmp_path / "whole" / "tensorboard")
    assert scalars == uninterrupted and ("validation", "epoch_accuracy", 1) in scalars
    metrics = [json.loads((path / "metrics.json").read_text()) for path in (tmp_path / "whole", run)]
    for key in ("best_validation_accuracy", "best_test_accuracy", "test_accuracy", "test_loss"):
        assert metrics[0][key] == metrics[1][key], key
    for noise in ("shuffle=True", "ran out of data"):
        assert noise not in resumed.stderr and noise not in whole.stderr
