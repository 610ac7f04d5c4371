"""Files written whole or not at all (`keras_vit.files.atomic_path`), under real write failures."""

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_vit import callbacks, export
from keras_vit.checkpoints import read_checkpoint
from keras_vit.files import atomic_path, write_bytes_atomically, write_text_atomically
from tests.builders import small_vit

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 8192

# Every writer, in a child process whose writes fail past 8 KiB (RLIMIT_FSIZE, as a full disk or a quota):
# first each file is written whole (no limit yet) and copied aside, then the limit is set and each writer
# writes it again, and once more to a new path.  `control` writes in place, as the writers did before.
CHILD = r"""
import json, os, resource, shutil, signal, sys
import numpy as np
import tensorflow as tf
import keras_vit
from experiments import outputs
from keras_vit import callbacks, visualize
from keras_vit.files import atomic_path

root = sys.argv[1]
model = keras_vit.build_vit("testing", image_size=16, patch_size=4, hidden_dim=16, num_layers=2, num_heads=4,
                            mlp_dim=32, num_classes=5)


def save_keras(path):  # As experiments/train.py saves model.keras.
    with atomic_path(path, suffix=".keras") as temporary:
        model.save(temporary)


def best(path):  # As experiments/train.py saves best.keras.
    checkpoint = callbacks.AtomicModelCheckpoint(path, monitor="val_accuracy", mode="max", save_best_only=True)
    checkpoint.set_model(model)
    checkpoint.on_epoch_end(0, {"val_accuracy": 0.5})


def figure(path):
    plt = visualize.pyplot()
    fig = plt.figure()
    plt.imshow(np.random.default_rng(0).random((300, 300)))
    visualize.save_figure(fig, path)


def csv_log(path):  # 800 more rows than the file has.
    log = callbacks.CSVLog(path)
    log.on_train_begin()
    log.header = ["epoch", "loss"]
    log.rows.extend(f"{i},{i / 7:.6f}" for i in range(len(log.rows), len(log.rows) + 800))
    log.on_epoch_end(len(log.rows), {"loss": 0.5})


def control(path):
    with open(path, "wb") as f:
        f.write(os.urandom(4 * 8192))


writers = {
    "vit.npz": lambda path: keras_vit.save_npz(model, path),
    "vit.safetensors": lambda path: keras_vit.save_timm(model, path),
    "metrics.json": lambda path: outputs.write_json(path, {"values": list(range(3000))}),
    "model.keras": save_keras,
    "best.keras": best,
    "figure.png": figure,
    "log.csv": csv_log,
    "control.bin": control,
}
for name, write in writers.items():
    write(os.path.join(root, "old", name))
    shutil.copy(os.path.join(root, "old", name), os.path.join(root, "reference", name))
keras_vit.save_npz(model, "ram://old/vit.npz")
with tf.io.gfile.GFile("ram://old/vit.npz", "rb") as f:
    ram_before = f.read()

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # A write past the limit raises OSError (EFBIG).
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
errors = {}
for name, write in writers.items():
    for folder in ("old", "new"):
        try:
            write(os.path.join(root, folder, name))
            errors[f"{folder}/{name}"] = None
        except Exception as error:
            errors[f"{folder}/{name}"] = f"{type(error).__name__}: {error}"
try:
    keras_vit.save_npz(model, "ram://old/vit.npz")
    errors["ram"] = None
except Exception as error:
    errors["ram"] = f"{type(error).__name__}: {error}"
with tf.io.gfile.GFile("ram://old/vit.npz", "rb") as f:
    ram_intact = f.read() == ram_before
print(json.dumps({"errors": errors, "ram_intact": ram_intact, "ram_files": tf.io.gfile.listdir("ram://old")}))
"""

NAMES = ["vit.npz", "vit.safetensors", "metrics.json", "model.keras", "best.keras", "figure.png", "log.csv"]


@pytest.fixture(scope="module")
def failed_writes(tmp_path_factory):
    root = tmp_path_factory.mktemp("writes")
    for folder in ("old", "new", "reference"):
        (root / folder).mkdir()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(root)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root, json.loads(result.stdout.strip().splitlines()[-1])


def test_the_injected_failure_destroys_a_file_written_in_place(failed_writes):
    """The fault is real: written in place, as the writers did before, a 32 KiB file becomes an 8 KiB stub, and
    a new path gets the stub."""
    root, report = failed_writes
    assert (root / "reference" / "control.bin").stat().st_size == 4 * LIMIT
    assert (root / "old" / "control.bin").stat().st_size == LIMIT
    assert (root / "new" / "control.bin").stat().st_size == LIMIT
    assert "File too large" in report["errors"]["old/control.bin"]


@pytest.mark.parametrize("name", NAMES)
def test_a_failed_write_keeps_the_previous_file_and_leaves_nothing_behind(failed_writes, name):
    root, report = failed_writes
    reference = (root / "reference" / name).read_bytes()
    assert len(reference) > LIMIT  # Every write below crossed the limit.
    # Both writes failed with the limit's error, raised to the caller.
    assert "File too large" in report["errors"][f"old/{name}"], report["errors"]
    assert "File too large" in report["errors"][f"new/{name}"], report["errors"]
    # The previous file, byte for byte; no partial file under a new name; no temporary anywhere.
    assert (root / "old" / name).read_bytes() == reference
    assert sorted(os.listdir(root / "old")) == sorted([*NAMES, "control.bin"])
    assert os.listdir(root / "new") == ["control.bin"], os.listdir(root / "new")


def test_the_previous_checkpoints_still_load(failed_writes):
    root, _ = failed_writes
    npz = read_checkpoint(str(root / "old" / "vit.npz"))
    timm = read_checkpoint(str(root / "old" / "vit.safetensors"))
    assert npz["head/kernel"].shape == (16, 5) and timm["head.weight"].shape == (5, 16)
    assert json.loads((root / "old" / "metrics.json").read_text())["values"][-1] == 2999


def test_a_failed_write_to_ram_keeps_the_previous_file(failed_writes):
    """ram:// stands for gs://: the file is written locally first, so the failure comes before any copy."""
    _, report = failed_writes
    assert "File too large" in report["errors"]["ram"]
    assert report["ram_intact"] and report["ram_files"] == ["vit.npz"]


@pytest.mark.parametrize("root", ["local", "ram://files"])
def test_an_error_inside_the_block_keeps_the_previous_file(tmp_path, root):
    folder = str(tmp_path) if root == "local" else root
    path = f"{folder}/weights.bin"
    assert write_bytes_atomically(path, b"old") == path
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_path(path) as temporary:
            with open(temporary, "wb") as f:
                f.write(b"partial")
            raise RuntimeError("interrupted")
    with tf.io.gfile.GFile(path, "rb") as f:
        assert f.read() == b"old"
    assert tf.io.gfile.listdir(folder) == ["weights.bin"]
    write_text_atomically(path, "new é")
    with tf.io.gfile.GFile(path, "rb") as f:
        assert f.read() == "new é".encode()
    assert tf.io.gfile.listdir(folder) == ["weights.bin"]
    if root == "local":  # The temporary lies beside the destination, hidden; the file keeps its mode.
        os.chmod(path, 0o600)
        write_bytes_atomically(path, b"private")
        assert os.stat(path).st_mode & 0o777 == 0o600
        with atomic_path(path, suffix=".keras") as temporary:
            assert os.path.dirname(temporary) == folder
            assert os.path.basename(temporary).startswith(".weights.bin.tmp-") and temporary.endswith(".keras")
    else:
        tf.io.gfile.remove(path)


def tree(folder):
    """{relative path: bytes} of every file under `folder` (any tf.io.gfile file system)."""
    files = {}
    for directory, _, names in tf.io.gfile.walk(folder):
        for name in names:
            with tf.io.gfile.GFile(f"{directory}/{name}", "rb") as f:
                files[f"{directory}/{name}"[len(folder) + 1:]] = f.read()
    return files


def write_tree(folder, files):
    for name, data in files.items():
        tf.io.gfile.makedirs(os.path.dirname(f"{folder}/{name}"))
        with tf.io.gfile.GFile(f"{folder}/{name}", "wb") as f:
            f.write(data)


@pytest.mark.parametrize("root", ["local", "ram://folders"])
def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path, root):
    parent = str(tmp_path) if root == "local" else root
    path = f"{parent}/saved_model"
    old = {"saved_model.pb": b"old graph", "variables/variables.index": b"old index"}
    write_tree(path, old)
    with pytest.raises(OSError, match="disk full"):
        with atomic_path(path) as temporary:
            write_tree(temporary, {"saved_model.pb": b"new graph"})
            raise OSError("disk full")
    assert tree(path) == old
    assert tf.io.gfile.listdir(parent) == ["saved_model"]
    new = {"saved_model.pb": b"new graph", "assets/names.txt": b"cat"}
    with atomic_path(path) as temporary:
        write_tree(temporary, new)
    assert tree(path) == new  # The old files are gone with the old folder.
    assert tf.io.gfile.listdir(parent) == ["saved_model"]
    with atomic_path(path):
        pass  # Nothing written: the destination stays.
    assert tree(path) == new
    if root != "local":
        tf.io.gfile.rmtree(parent)


def test_export_keeps_the_previous_saved_model_when_saving_fails(tmp_path, monkeypatch):
    model = small_vit(num_classes=3)  # The three class names below.
    path = export.export_saved_model(model, tmp_path / "sm")
    before = tree(path)
    save = tf.saved_model.save

    def fails_when_half_written(obj, export_dir, signatures=None):
        save(obj, export_dir, signatures=signatures)
        tf.io.gfile.rmtree(f"{export_dir}/variables")
        raise OSError("disk full")

    monkeypatch.setattr(tf.saved_model, "save", fails_when_half_written)
    with pytest.raises(OSError, match="disk full"):
        export.export_saved_model(model, path, class_names=["a", "b", "c"], overwrite=True)
    assert tree(path) == before
    assert os.listdir(tmp_path) == ["sm"]
    monkeypatch.setattr(tf.saved_model, "save", save)
    export.export_saved_model(model, path, class_names=["a", "b", "c"], overwrite=True)
    served = tf.saved_model.load(path).signatures["serving_default"](images=tf.zeros([1, 16, 16, 3], tf.uint8))
    assert sorted(served["top_k_names"].numpy()[0].tolist()) == [b"a", b"b", b"c"]  # The new model's.
    assert os.listdir(tmp_path) == ["sm"]


def test_the_checkpoint_callback_saves_only_better_epochs(tmp_path):
    model = small_vit()
    path = tmp_path / "best.keras"
    checkpoint = callbacks.AtomicModelCheckpoint(
        path, monitor="val_accuracy", mode="max", save_best_only=True, initial_value_threshold=0.5
    )
    checkpoint.set_model(model)
    checkpoint.on_epoch_end(0, {"val_accuracy": 0.4})  # Not better than the threshold: nothing written.
    assert os.listdir(tmp_path) == []
    checkpoint.on_epoch_end(1, {"val_accuracy": 0.6})
    saved = path.read_bytes()
    kernel = model.layers[-1].kernel
    kernel.assign(kernel + 1.0)
    checkpoint.on_epoch_end(2, {"val_accuracy": 0.55})  # Worse: best.keras stays the epoch-1 model.
    assert path.read_bytes() == saved
    checkpoint.on_epoch_end(3, {"val_accuracy": 0.7})
    assert os.listdir(tmp_path) == ["best.keras"] and checkpoint.filepath == str(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(loaded.layers[-1].kernel.numpy(), kernel.numpy())
    with pytest.raises(ValueError, match="once per epoch"):
        callbacks.AtomicModelCheckpoint(path, save_freq=10)
