"""The entry points, run as a user runs them."""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from keras_vit import data as vit_data
from tests.conftest import ROOT, run_command_line, run_module

# The jobs, and the flags each defines when it runs as a program.
JOB_FLAGS = {
    "train": ["config", "distribution", "mesh_shape", "multi_host", "overwrite", "profile_phases", "strategy", "tpu",
              "workdir"],
    "scaling": ["config", "workdir"],
    "transfer": ["config", "workdir"],
    "export": [
        "calibration_images", "class_names", "default_signature", "format", "max_aspect_ratio", "max_pixels", "model",
        "out", "overwrite", "pretrained", "warmup",
    ],
    "predict": ["batch_size", "crop_fraction", "images", "max_aspect_ratio", "max_pixels", "model", "out", "top_k"],
    "visualize": ["image", "model", "out"],
    "evaluate": [
        "batch_size", "crop_fraction", "data_dir", "dataset", "model", "out", "seed", "split", "test_fraction",
    ],
    "data_service": ["dispatcher", "port", "role", "work_dir", "worker_address"],
}
# What the jobs build from a config, and their command line.
HELPERS = ("models", "datasets", "extra_test_sets", "outputs", "jobs")
def test_the_jobs_import_together_and_define_no_flag():
    """Every module of experiments/ (the jobs, the benchmark's modes, the configs) imported together, as
    libraries: no flag defined, nothing started (two jobs' flags of one name would otherwise clash:
    DuplicateFlagError). Each job's flags are defined when its command line runs (`jobs.run_job`), and
    its --help lists them."""
    import importlib
    import pkgutil
    import re

    from absl import app, flags

    import experiments

    app.define_help_flags()  # What app.run defines on its first call: --help and its kin.
    modules = {
        info.name: importlib.import_module(info.name)
        for info in pkgutil.walk_packages(experiments.__path__, "experiments.")
    }
    expected = {f"experiments.{name}" for name in [*JOB_FLAGS, *HELPERS, "benchmark", "benchmark.cli", "configs"]}
    assert expected <= set(modules), sorted(modules)
    # No flag of absl's registry comes from experiments/, whichever modules this process imported before.
    defined = {name: flags.FLAGS.find_module_defining_flag(name, "") for name in flags.FLAGS}
    assert not [name for name, module in defined.items() if module.startswith("experiments")]
    helps = {}
    for name in JOB_FLAGS:
        # The job's command line, as `python -m experiments.NAME --help` runs it: run_job defines the flags.
        printed = run_command_line(f"experiments.{name}", "--help", exit_code=0)
        helps[name] = sorted(re.findall(r"^  --(?:\[no\])?(\w+)", printed, flags=re.M))
    assert helps == JOB_FLAGS


@pytest.mark.parametrize("module", ["models", "extra_test_sets"])
def test_job_helper_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"experiments.{module}"), verbose=False)
    assert result.attempted > 0 and result.failed == 0


# TensorFlow's own C++ log lines at warning or error level that a healthy run on a CPU shows and the library
# cannot prevent (docs/training.md, "Stopped, resumed, run again"): its CUDA build's failed cuInit where there is
# no NVIDIA driver. On the CPU the job runs without a strategy, so no distributed dataset logs its own lines.
TENSORFLOWS_OWN = ("cuda_platform.cc",)


@pytest.mark.slow
def test_a_healthy_main_job_logs_no_warning_of_its_own(digits_main_job):
    """The README's main command's stderr, as the user's terminal shows it: no Python warning, no warning or
    error logged from Python (Keras, TensorFlow's Python, the job), no traceback; TensorFlow's C++ lines at
    warning or error level only those listed above."""
    _, _, stderr = digits_main_job
    lines = stderr.splitlines()
    python_level = [line for line in lines if re.match(r"(W|E)\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.py:\d+\]", line)]
    native = [line for line in lines if re.match(r"(W|E)0000 00:00:", line)]
    assert not python_level, python_level
    assert not [line for line in native if not any(f" {name}:" in line for name in TENSORFLOWS_OWN)], native
    for noise in ("Warning:", "WARNING:tensorflow", "Traceback", "shuffle=True", "ran out of data", "retracing"):
        assert noise not in stderr, [line for line in lines if noise in line]


@pytest.mark.slow
def test_main_job_with_defaults_reaches_97_percent(digits_main_job):
    """The README's main command, defaults unchanged."""
    workdir, stdout, _ = digits_main_job
    assert str(workdir) in stdout
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.97, metrics
    assert metrics["epochs"] == 60 and metrics["train_images_per_second"] > 0
    assert np.isfinite(metrics["test_loss"])
    # Model selection on the validation split (10% of the training images); the test split read after training,
    # for the final model and for best.keras.
    assert {name: split["examples"] for name, split in metrics["splits"].items()} == {
        "train": 1293, "validation": 144, "test": 360
    }
    assert metrics["best_test_accuracy"] >= 0.95 and metrics["best_validation_accuracy"] >= 0.95, metrics
    assert metrics["steps"] == 60 * (1293 // 64)
    # The job's final evaluation (eval/) is that of the final model.
    final = json.loads((workdir / "eval" / "eval.json").read_text())
    assert final["top1_accuracy"] == pytest.approx(metrics["test_accuracy"])
    assert (workdir / "eval" / "confusion_matrix.png").exists() and (workdir / "eval" / "reliability.png").exists()

    # The saved model is the trained one: it reproduces the reported accuracy.
    model = keras.saving.load_model(workdir / "model.keras")
    dataset = vit_data.load_digits(image_size=16, test_fraction=0.2, seed=0)
    predictions = model.predict(dataset.test.images, verbose=0).argmax(-1)
    accuracy = float((predictions == dataset.test.labels).mean())
    assert abs(accuracy - metrics["test_accuracy"]) < 1e-6
    history = json.loads((workdir / "history.json").read_text())
    assert len(history["loss"]) == 60
    assert not (workdir / "backup").exists()  # Removed after a completed run.

    # The grid structure of the paper's Figure 7 appears in the position embeddings.
    assert metrics["position_similarity_neighbours"] > metrics["position_similarity_distant"] + 0.2
    figures = sorted(p.name for p in (workdir / "figures").iterdir())
    assert len(figures) == 12 and {"test0_attention_rollout.png", "test1_patch_grid.png"} <= set(figures)


def test_config_overrides_from_the_command_line(tmp_path):
    """--config.FIELD=VALUE on the training job's command line reaches the config and the model it builds."""
    from experiments import models

    seen = {}
    run_command_line(
        "experiments.train",
        f"--workdir={tmp_path}",
        "--config.epochs=2",
        "--config.model.num_layers=1",
        "--config.model.classifier=gap",
        "--config.jit_compile=on",
        "--config.steps_per_execution=4",
        "--config.export=saved_model,tflite",
        main=lambda cli: seen.update(config=cli.config.value, workdir=cli.workdir.value),
    )
    config = seen["config"]
    assert seen["workdir"] == str(tmp_path)
    assert (config.epochs, config.jit_compile, config.steps_per_execution) == (2, "on", 4)
    assert config.export == "saved_model,tflite" and config.batch_size == 64  # the digits config's otherwise
    model = models.build_model(config, 10)
    assert model.get_layer("pooling").method == "gap"
    names = [layer.name for layer in model.layers]
    assert names.count("encoderblock_0") == 1
    assert "encoderblock_1" not in names


@pytest.mark.slow
def test_the_job_writes_the_model_metrics_figures_and_exports(digits_job):
    """The training job (a short run on the digits, exports asked for): what it writes."""
    workdir, config, metrics, (phases, seconds) = digits_job
    assert (workdir / "export" / "saved_model" / "saved_model.pb").exists()
    assert (workdir / "export" / "tflite.tflite").stat().st_size > 0
    assert metrics["export_tflite"] == str(workdir / "export" / "tflite.tflite")
    assert metrics["epochs"] == config.epochs == 2
    # 4 steps per execution divide the epoch's 20: each epoch runs its steps and no more.
    assert metrics["steps"] == 2 * (1293 // 64)
    model = keras.saving.load_model(workdir / "model.keras")
    assert [layer.name for layer in model.layers].count("encoderblock_0") == 1
    assert len(list((workdir / "figures").iterdir())) == 12
    # The seconds of its phases (--profile_phases prints them) account for the job's, each phase timed apart.
    names = list(phases.seconds)
    for phase in ("checks, data", "training: first step (tracing, compiling)", "training: the other steps",
                  "validation in fit", "test split: evaluated, eval/ written", "figures", "exports",
                  "best.keras: evaluated unless it is the final model", "metrics.json, history.json written"):
        assert phase in names, (phase, names)
    assert all(value >= 0 for value in phases.seconds.values())
    assert phases.seconds["exports"] > 0.5 and phases.seconds["training: the other steps"] > 0  # two exports
    assert sum(phases.seconds.values()) == pytest.approx(seconds, rel=0.05)
    table = phases.table().splitlines()
    assert table[0].split() == ["phase", "seconds", "share"] and len(table) == len(names) + 3
    assert table[-1].startswith("outside the training steps")


@pytest.mark.slow
def test_training_from_a_pretrained_checkpoint_with_a_frozen_backbone(tmp_path):
    from experiments import train
    from tests.builders import tiny_digits_config

    config = tiny_digits_config(epochs=1)
    config.visualize = False
    model_config = dict(config.model)
    source = keras_vit.build_vit(
        model_config.pop("variant"), image_size=config.image_size, num_classes=7, **model_config
    )
    keras_vit.save_npz(source, str(tmp_path / "pretrained.npz"))
    config.pretrained, config.freeze_backbone = str(tmp_path / "pretrained.npz"), True
    train.train_and_evaluate(config, str(tmp_path / "run"))
    trained = keras.saving.load_model(tmp_path / "run" / "model.keras")
    # The backbone is the checkpoint's, untouched by training; the 10-class head was trained.
    for layer in source.layers:
        if layer.name != "head":
            for a, b in zip(layer.get_weights(), trained.get_layer(layer.name).get_weights()):
                np.testing.assert_array_equal(a, b)
    assert trained.get_layer("head").kernel.shape == (config.model.hidden_dim, 10)
    assert np.abs(trained.get_layer("head").kernel.numpy()).max() > 0


@pytest.mark.slow
def test_visualize_command(tmp_path):
    model = keras_vit.build_vit("testing", image_size=32, num_classes=3, patch_size=8)
    model.save(tmp_path / "m.keras")
    image = np.random.default_rng(0).integers(0, 256, (50, 70, 3)).astype(np.uint8)
    (tmp_path / "image.png").write_bytes(tf.io.encode_png(image).numpy())
    out = tmp_path / "figures"
    stdout = run_module(
        "experiments.visualize", f"--model={tmp_path / 'm.keras'}", f"--image={tmp_path / 'image.png'}", f"--out={out}"
    )
    written = sorted(p.name for p in out.iterdir())
    assert written == [
        "attention_rollout.png",
        "embedding_filters.png",
        "head_attention.png",
        "mean_attention_distance.png",
        "patch_grid.png",
        "position_similarity.png",
    ]
    assert all(str(out / name) in stdout for name in written)


def test_visualize_command_refuses_a_file_that_is_not_an_image(tmp_path, capsys):
    keras_vit.build_vit("testing", image_size=32, num_classes=3).save(tmp_path / "m.keras")
    (tmp_path / "notes.png").write_text("not an image")
    run_command_line("experiments.visualize", f"--model={tmp_path / 'm.keras'}", f"--image={tmp_path / 'notes.png'}",
                     f"--out={tmp_path}", exit_code=2)  # fmt: skip
    error = capsys.readouterr().err
    assert "is not an image TensorFlow can decode" in error and "Traceback" not in error


def test_digits_data():
    dataset = vit_data.load_digits(image_size=16, test_fraction=0.2, seed=0)
    assert dataset.train.images.shape == (1437, 16, 16, 3)
    assert dataset.test.images.shape == (360, 16, 16, 3)
    assert dataset.train.images.dtype == np.uint8 and dataset.train.images.max() == 255
    # Stratified: every class is in the test split in its proportion (~36 each).
    assert set(np.bincount(dataset.test.labels)) <= set(range(34, 39))
    train = vit_data.make_pipeline(dataset.train, 64, training=True, num_classes=10, max_shift=2)
    images, labels = next(iter(train))
    assert images.shape == (64, 16, 16, 3) and images.dtype == "uint8"
    assert labels.shape == (64, 10)
    assert len(list(train)) == 1437 // 64  # drop_remainder for training
    test = vit_data.make_pipeline(dataset.test, 64, training=False)
    assert sum(len(y) for _, y in test) == 360  # every test example kept, in order


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_backup(tmp_path):
    """SIGKILL in the middle of an epoch; the same command again finishes the run."""
    import signal
    import time

    # One block, no XLA: an epoch of a few seconds, killed half a second into its third.
    args = [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--config.epochs=4",
            "--config.visualize=False", "--config.model.num_layers=1", "--config.jit_compile=off",
            "--config.tensorboard_figures=0"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith("Epoch 3/4"):  # epochs 1-2 are backed up; kill inside epoch 3
            time.sleep(0.5)
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "".join(seen[-20:])
    assert (tmp_path / "backup").exists() and not (tmp_path / "metrics.json").exists()

    # The same command line again (in this process: the kill above was the program's own).
    stdout = run_command_line("experiments.train", *args[3:])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    steps_per_epoch = 1293 // 64  # 1,437 training images less the 144 held out for validation
    assert metrics["steps"] == 4 * steps_per_epoch  # the same as an uninterrupted run
    history = json.loads((tmp_path / "history.json").read_text())
    assert "Epoch 1/4" not in stdout and "Epoch 3/4" in stdout  # only epochs 3-4 ran again
    log = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert len(history["loss"]) == 4  # every epoch, those of the killed process included, as log.csv has them
    column = log[0].split(",").index("loss")
    assert history["loss"] == [float(row.split(",")[column]) for row in log[1:]]
    assert [row.split(",")[0] for row in log[1:]] == ["0", "1", "2", "3"]  # epoch 3 once, from the resumed run
    # best.keras: the best epoch of both processes, on the validation split.
    column = log[0].split(",").index("val_accuracy")
    best = max(float(row.split(",")[column]) for row in log[1:])
    assert metrics["best_validation_accuracy"] == pytest.approx(best, abs=1e-6)
    assert not (tmp_path / "backup").exists()


class ReplicasInSync(keras.callbacks.Callback):
    """At the end of training: how many weights are mirrored and the largest gap between the replicas' copies."""

    def on_train_end(self, logs=None):
        gaps = [float(np.max(np.abs(v.value.values[0].numpy() - v.value.values[-1].numpy())))
                for v in self.model.weights if hasattr(v.value, "values")]  # fmt: skip
        self.seen = {"jit_compile": self.model.jit_compile, "mirrored": len(gaps),
                     "weights": len(self.model.weights), "largest_gap": max(gaps, default=0.0)}  # fmt: skip


@pytest.fixture(scope="module")
def mirrored_runs(tmp_path_factory, two_replicas):
    """The training job under MirroredStrategy over two (logical) CPU devices and under one device, one after
    the other in the two_cpus child: {label: (workdir, what the run reported)}."""
    from experiments import train
    from experiments.configs import digits
    from keras_vit.distribute import get_strategy

    root = tmp_path_factory.mktemp("mirrored")
    strategies, runs = {"mirrored": two_replicas, "one_device": get_strategy("one_device")}, {}
    for label, name, epochs, mode in (
        ("defaults", "mirrored", 2, "defaults"),  # The shipped digits config.
        ("one_device", "one_device", 1, "compare"),
        ("mirrored", "mirrored", 1, "compare"),
    ):
        config = digits.get_config()
        config.epochs, config.visualize = epochs, False
        if mode == "compare":
            config.max_shift = 0
            config.model.dropout_rate = config.model.stochastic_depth_rate = 0.0  # no per-replica randomness
            config.model.num_layers = 1
            config.grad_clip_norm = 0.05
            config.tensorboard_figures = 0  # The losses are compared; the defaults run has the figures.
        sync = ReplicasInSync()
        train.train_and_evaluate(config, str(root / label), strategies[name], callbacks=[sync])
        runs[label] = (root / label, {"replicas": strategies[name].num_replicas_in_sync, **sync.seen})
    return runs


@pytest.mark.slow
@pytest.mark.environment("two_cpus")
def test_mirrored_over_two_cpu_devices_with_the_default_config(mirrored_runs):
    """The shipped digits config, XLA as `jit_compile="auto"` picks it: it trains, and both
    replicas end with the same weights."""
    workdir, run = mirrored_runs["defaults"]
    assert run["replicas"] == 2
    assert run["jit_compile"] is False  # Keras' rule under tf.distribute.
    assert run["mirrored"] == run["weights"] > 0
    assert run["largest_gap"] == 0.0
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["steps"] == 2 * (1293 // 64)  # 1,437 training images less 144 for validation
    loss = json.loads((workdir / "history.json").read_text())["loss"]
    assert loss[1] < loss[0], loss  # It learns (the warm-up lasts 5 epochs).


@pytest.mark.slow
@pytest.mark.environment("two_cpus")
def test_mirrored_over_two_cpu_devices_matches_one_device(mirrored_runs):
    """Also with gradient clipping active (norm 0.05): the global gradient is clipped, not each replica's."""
    losses = {}
    for name in ("one_device", "mirrored"):
        workdir, run = mirrored_runs[name]
        assert run["replicas"] == (2 if name == "mirrored" else 1)
        assert run["jit_compile"] is (name == "one_device")  # float32 training on one device: XLA.
        losses[name] = json.loads((workdir / "history.json").read_text())["loss"]
    # The same global batches and the same mean gradient, summed in another order (and, as
    # "auto" picks, compiled by XLA on one device but not under MirroredStrategy).
    np.testing.assert_allclose(losses["mirrored"], losses["one_device"], rtol=2e-3)


def test_unknown_strategy_and_unresolvable_tpu():
    from keras_vit.distribute import get_strategy

    with pytest.raises(ValueError, match="strategy='gpu'"):
        get_strategy("gpu")
    with pytest.raises(ValueError, match="Could not resolve or initialise the TPU 'no-such-tpu'"):
        get_strategy("tpu", "no-such-tpu")
    with pytest.raises(ValueError, match="needs TF_CONFIG"):
        get_strategy("multi_worker")


@pytest.mark.slow
def test_training_on_an_image_folder_with_a_remote_workdir(tmp_path):
    """folder: data with a corrupt file, MixUp in the step, and a workdir on TensorFlow's ram:// file
    system (as gs://)."""
    from experiments import train
    from experiments.configs import digits
    from tests.builders import write_folder

    root = write_folder(tmp_path / "images", per_class=8, corrupt=["cat/broken.png"])
    config = digits.get_config()
    config.dataset = f"folder:{root}"
    config.image_size, config.batch_size, config.epochs, config.warmup_epochs = 16, 4, 2, 1
    config.model.update(patch_size=4, num_layers=1, hidden_dim=16, mlp_dim=32, num_heads=2)
    config.visualize_images = 1
    config.augment.randaugment, config.augment.mixup_alpha = (2, 5), 0.2
    config.export = "tflite:int8"
    metrics = train.train_and_evaluate(config, "ram://run")
    names = ["model.keras", "best.keras", "metrics.json", "history.json", "log.csv",
             "figures/test0_attention_rollout.png", metrics["export_tflite_int8"][len("ram://run/"):]]  # fmt: skip
    exists = {name: tf.io.gfile.exists("ram://run/" + name) for name in names}
    # 25 files listed by name; the corrupt one is skipped when the pipeline decodes it, and named.
    assert metrics["train_examples"] + metrics["validation_examples"] + metrics["test_examples"] == 25
    assert (metrics["validation_examples"], metrics["test_examples"]) == (2, 5)
    assert metrics["skipped_files"] == 1 and metrics["skipped_examples"] == [f"{root}/cat/broken.png"]
    assert metrics["steps"] == 2 * (metrics["train_examples"] // 4)
    assert metrics["export_tflite_int8"] == "ram://run/export/tflite_int8.tflite"
    assert all(exists.values()) and len(exists) == 7, exists


@pytest.mark.slow
@pytest.mark.environment("jax")
@pytest.mark.parametrize("flags, expected", [
    ((), "DataParallel over a {'batch': 2} mesh"),  # The default: every device, data parallel.
    (("--distribution=model_parallel", "--mesh_shape=1,2"), "ModelParallel over a {'batch': 1, 'model': 2} mesh"),
])
def test_the_training_command_on_jax_spreads_over_every_device(tmp_path, caplog, flags, expected):
    """KERAS_BACKEND=jax with 2 (simulated) devices: the job trains under keras.distribution and says so."""
    import logging

    assert keras.backend.backend() == "jax"
    try:
        with caplog.at_level(logging.INFO, logger="absl"):
            run_command_line("experiments.train", f"--workdir={tmp_path}", "--config.epochs=1",
                             "--config.visualize=False", "--config.model.num_layers=1",
                             "--config.model.hidden_dim=16", "--config.model.mlp_dim=32", *flags)  # fmt: skip
    finally:
        keras.distribution.set_distribution(None)
    assert f"Distribution: {expected}" in caplog.text, caplog.text[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 1293 // 64 and np.isfinite(metrics["test_loss"])


@pytest.mark.environment("jax")
def test_jax_hosts_read_their_own_files_when_each_holds_whole_replicas(monkeypatch):
    """Two hosts (simulated) with a replica each read their own files and batch 64 / 2; where one
    model replica spans both, Keras' sharding by example stays."""
    import jax

    from experiments import datasets
    from keras_vit import distribute

    monkeypatch.setattr(jax, "process_count", lambda: 2)  # Host 1 of 2, simulated.
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    seen = {}
    try:
        for kind, mesh in (("data_parallel", (2,)), ("model_parallel", (1, 2))):
            distribution = distribute.make_distribution(kind, mesh)
            keras.distribution.set_distribution(distribution)
            context = datasets.jax_input_context()
            seen[kind] = context and [context.num_input_pipelines, context.input_pipeline_id,
                                      context.get_per_replica_batch_size(64), distribution.auto_shard_dataset]
    finally:
        keras.distribution.set_distribution(None)
    assert seen == {"data_parallel": [2, 1, 32, False], "model_parallel": None}
