"""The entry points, run as a user runs them."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from keras_vit import data as vit_data
from tests.conftest import ROOT, run_module

# The jobs, and the flags each defines when it runs as a program.
JOB_FLAGS = {
    "train": ["config", "distribution", "mesh_shape", "multi_host", "strategy", "tpu", "workdir"],
    "scaling": ["config", "workdir"],
    "transfer": ["config", "workdir"],
    "export": [
        "calibration_images", "class_names", "format", "max_aspect_ratio", "max_pixels", "model", "out", "overwrite",
        "pretrained", "quantize",
    ],
    "visualize": ["image", "model", "out"],
    "evaluate": [
        "batch_size", "crop_fraction", "data_dir", "dataset", "model", "out", "seed", "split", "test_fraction",
    ],
    "data_service": ["dispatcher", "port", "role", "work_dir", "worker_address"],
}
IMPORT_SCRIPT = """
import contextlib, importlib, io, json, pkgutil, re, sys
from absl import app, flags, logging
from ml_collections import config_flags
import keras, tensorflow, keras_vit
app.define_help_flags()  # What app.run defines on its first call: --help and its kin.
before = set(flags.FLAGS)
import experiments
modules = {
    info.name: importlib.import_module(info.name)
    for info in pkgutil.walk_packages(experiments.__path__, "experiments.")
}
seen = {"imported": sorted(modules), "defined_on_import": sorted(set(flags.FLAGS) - before), "help": {}}
from experiments import common
for name in sys.argv[1:]:
    module = modules["experiments." + name]
    # The job's command line, as `python -m experiments.NAME --help` runs it: run_job defines the flags.
    sys.argv = [f"{name}.py", "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        common.run_job(module.main, module.define_flags)
    seen["help"][name] = sorted(re.findall(r"^  --(?:\\[no\\])?(\\w+)", out.getvalue(), flags=re.M))
    for flag in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, flag)
print(json.dumps(seen))
"""


def test_the_jobs_import_together_and_define_no_flag():
    """Every module of experiments/ (the jobs, the benchmark's modes, the configs) imported in one process,
    as libraries: no flag defined, nothing started (two jobs' flags of one name would otherwise clash:
    DuplicateFlagError). Each job's flags are defined when its command line runs (`common.run_job`), and
    its --help lists them."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_SCRIPT, *JOB_FLAGS], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {f"experiments.{name}" for name in [*JOB_FLAGS, "common", "benchmark", "benchmark.cli", "configs"]}
    assert expected <= set(seen["imported"]), seen["imported"]
    assert seen["defined_on_import"] == []
    assert seen["help"] == JOB_FLAGS


def test_common_examples():
    import doctest

    from experiments import common

    result = doctest.testmod(common, verbose=False)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow
def test_main_job_with_defaults_reaches_97_percent(digits_main_job):
    """The README's main command, defaults unchanged."""
    workdir, stdout = digits_main_job
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


@pytest.mark.slow
def test_config_overrides_from_the_command_line(tmp_path):
    stdout = run_module(
        "experiments.train",
        f"--workdir={tmp_path}",
        "--config.epochs=2",
        "--config.model.num_layers=1",
        "--config.model.classifier=gap",
        "--config.jit_compile=on",
        "--config.steps_per_execution=4",
        "--config.export=saved_model,tflite",
    )
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (tmp_path / "export" / "saved_model" / "saved_model.pb").exists()
    assert (tmp_path / "export" / "tflite.tflite").stat().st_size > 0
    assert metrics["export_tflite"] == str(tmp_path / "export" / "tflite.tflite")
    assert metrics["epochs"] == 2 and "test_accuracy" in stdout
    model = keras.saving.load_model(tmp_path / "model.keras")
    assert model.get_layer("pooling").method == "gap"
    names = [layer.name for layer in model.layers]
    assert names.count("encoderblock_0") == 1
    assert "encoderblock_1" not in names
    assert len(list((tmp_path / "figures").iterdir())) == 12


@pytest.mark.slow
def test_training_from_a_pretrained_checkpoint_with_a_frozen_backbone(tmp_path):
    from experiments.configs import digits

    config = digits.get_config()
    model_config = dict(config.model)
    source = keras_vit.build_vit(
        model_config.pop("variant"), image_size=config.image_size, num_classes=7, **model_config
    )
    keras_vit.save_npz(source, str(tmp_path / "pretrained.npz"))
    run_module(
        "experiments.train",
        f"--workdir={tmp_path / 'run'}",
        f"--config.pretrained={tmp_path / 'pretrained.npz'}",
        "--config.freeze_backbone=True",
        "--config.epochs=1",
        "--config.visualize=False",
    )
    trained = keras.saving.load_model(tmp_path / "run" / "model.keras")
    # The backbone is the checkpoint's, untouched by training; the 10-class head was trained.
    for layer in source.layers:
        if layer.name != "head":
            for a, b in zip(layer.get_weights(), trained.get_layer(layer.name).get_weights()):
                np.testing.assert_array_equal(a, b)
    assert trained.get_layer("head").kernel.shape == (64, 10)
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


def test_visualize_command_refuses_a_file_that_is_not_an_image(tmp_path):
    keras_vit.build_vit("testing", image_size=32, num_classes=3).save(tmp_path / "m.keras")
    (tmp_path / "notes.png").write_text("not an image")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.visualize", f"--model={tmp_path / 'm.keras'}",
         f"--image={tmp_path / 'notes.png'}", f"--out={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "is not an image TensorFlow can decode" in result.stderr


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

    args = [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--config.epochs=4",
            "--config.visualize=False", "--config.model.num_layers=1"]
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

    stdout = run_module("experiments.train", *args[3:])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    steps_per_epoch = 1293 // 64  # 1,437 training images less the 144 held out for validation
    assert metrics["steps"] == 4 * steps_per_epoch  # the same as an uninterrupted run
    history = json.loads((tmp_path / "history.json").read_text())
    assert len(history["loss"]) == 2  # only epochs 3-4 ran again
    assert "Epoch 1/4" not in stdout
    log = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert [row.split(",")[0] for row in log[1:]] == ["0", "1", "2", "3"]  # epoch 3 once, from the resumed run
    # best.keras: the best epoch of both processes, on the validation split.
    column = log[0].split(",").index("val_accuracy")
    best = max(float(row.split(",")[column]) for row in log[1:])
    assert metrics["best_validation_accuracy"] == pytest.approx(best, abs=1e-6)
    assert not (tmp_path / "backup").exists()


MIRRORED_SCRIPT = """
import json, sys
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from experiments import train
from experiments.configs import digits
from keras_vit.distribute import get_strategy

class ReplicasInSync(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        gaps = [float(np.max(np.abs(v.value.values[0].numpy() - v.value.values[-1].numpy())))
                for v in self.model.weights if hasattr(v.value, "values")]
        self.seen = {"jit_compile": self.model.jit_compile, "mirrored": len(gaps),
                     "weights": len(self.model.weights), "largest_gap": max(gaps, default=0.0)}

# One run per (label, strategy, epochs, mode), one after the other in this process; the runs of one kind
# share the strategy (two MirroredStrategy objects in one process would reuse each other's collective keys).
strategies = {}
for label, name, epochs, mode in json.loads(sys.argv[2]):
    config = digits.get_config()
    config.epochs, config.visualize = epochs, False
    if mode == "compare":
        config.max_shift = 0
        config.model.dropout_rate = config.model.stochastic_depth_rate = 0.0  # no per-replica randomness
        config.model.num_layers = 1
        config.grad_clip_norm = 0.05
    if name not in strategies:
        strategies[name] = get_strategy(name)
    strategy = strategies[name]
    sync = ReplicasInSync()
    train.train_and_evaluate(config, sys.argv[1] + "/" + label, strategy, callbacks=[sync])
    print("RUN " + json.dumps({"label": label, "replicas": strategy.num_replicas_in_sync, **sync.seen}))
"""


@pytest.fixture(scope="module")
def mirrored_runs(tmp_path_factory):
    """The training job under MirroredStrategy over two (logical) CPU devices and under one device, in one
    process: {label: (workdir, what the run reported)}."""
    root = tmp_path_factory.mktemp("mirrored")
    runs = [
        ("defaults", "mirrored", 2, "defaults"),  # The shipped digits config.
        ("one_device", "one_device", 1, "compare"),
        ("mirrored", "mirrored", 1, "compare"),
    ]
    stdout = run_module_script(MIRRORED_SCRIPT, str(root), json.dumps(runs))
    reports = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("RUN ")]
    assert [report["label"] for report in reports] == [label for label, *_ in runs]
    return {report["label"]: (root / report["label"], report) for report in reports}


@pytest.mark.slow
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


def run_module_script(script, *args):
    result = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


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
    from tests.test_data import write_folder

    root = write_folder(tmp_path / "images", per_class=8, corrupt=["cat/broken.png"])
    script = f"""
import json
import tensorflow as tf
from experiments import train
from experiments.configs import digits
config = digits.get_config()
config.dataset = "folder:{root}"
config.image_size, config.batch_size, config.epochs, config.warmup_epochs = 16, 4, 2, 1
config.model.patch_size, config.model.num_layers = 4, 1
config.visualize_images = 1
config.augment.randaugment, config.augment.mixup_alpha = (2, 5), 0.2
config.export = "tflite_int8"
metrics = train.train_and_evaluate(config, "ram://run")
print(json.dumps(metrics))
names = ["model.keras", "best.keras", "metrics.json", "history.json", "log.csv", "figures/test0_attention_rollout.png"]
print(json.dumps({{n: tf.io.gfile.exists("ram://run/" + n) for n in names + [metrics["export_tflite_int8"][len("ram://run/"):]]}}))
"""
    stdout = run_module_script(script)
    lines = stdout.strip().splitlines()
    metrics, exists = json.loads(lines[-2]), json.loads(lines[-1])
    # 25 files listed by name; the corrupt one is skipped when the pipeline decodes it, and named.
    assert metrics["train_examples"] + metrics["validation_examples"] + metrics["test_examples"] == 25
    assert (metrics["validation_examples"], metrics["test_examples"]) == (2, 5)
    assert metrics["skipped_files"] == 1 and metrics["skipped_examples"] == [f"{root}/cat/broken.png"]
    assert metrics["steps"] == 2 * (metrics["train_examples"] // 4)
    assert metrics["export_tflite_int8"] == "ram://run/export/tflite_int8.tflite"
    assert all(exists.values()) and len(exists) == 7, exists


@pytest.mark.slow
@pytest.mark.parametrize("flags, expected", [
    ((), "DataParallel over a {'batch': 8} mesh"),  # The default: every device, data parallel.
    (("--distribution=model_parallel", "--mesh_shape=2,4"), "ModelParallel over a {'batch': 2, 'model': 4} mesh"),
])
def test_the_training_command_on_jax_spreads_over_every_device(tmp_path, flags, expected):
    """KERAS_BACKEND=jax with 8 (simulated) devices: the job trains under keras.distribution and says so."""
    env = dict(
        os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
    )
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--config.epochs=1",
         "--config.visualize=False", "--config.model.num_layers=1", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert f"Distribution: {expected}" in output, output[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 1293 // 64 and np.isfinite(metrics["test_loss"])


JAX_HOSTS_SCRIPT = """
import json
import jax, keras
from experiments import common
from keras_vit import parallel
jax.process_count, jax.process_index = (lambda: 2), (lambda: 1)  # Host 1 of 2, simulated.
seen = {}
for kind, mesh in (("data_parallel", (2,)), ("model_parallel", (1, 2))):
    distribution = parallel.make_distribution(kind, mesh)
    keras.distribution.set_distribution(distribution)
    context = common.jax_input_context()
    seen[kind] = context and [context.num_input_pipelines, context.input_pipeline_id,
                              context.get_per_replica_batch_size(64), distribution.auto_shard_dataset]
print(json.dumps(seen))
"""


def test_jax_hosts_read_their_own_files_when_each_holds_whole_replicas():
    """Two hosts (simulated) with a replica each read their own files and batch 64 / 2; where one
    model replica spans both, Keras' sharding by example stays."""
    env = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", JAX_HOSTS_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"data_parallel": [2, 1, 32, False], "model_parallel": None}
