"""A run's backups: saved whole, the last two kept, restored whole, a damaged one named and passed over."""

import json
import logging

import keras
import numpy as np
import pytest

from keras_vit import backups, callbacks
from tests.builders import StopAfter


def make_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


DATA = (np.random.default_rng(0).normal(size=(32, 4)).astype("float32"), np.arange(32) % 3)


@pytest.fixture()
def interrupted(tmp_path):
    """A run killed after its third epoch: its backup folder, and its weights and optimizer step then."""
    keras.utils.set_random_seed(0)
    model, folder = make_model(), tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        model.fit(*DATA, batch_size=8, epochs=5, verbose=0,
                  callbacks=[callbacks.Backup(str(folder)), StopAfter(2)])  # fmt: skip
    return folder, [w.numpy() for w in model.weights], int(model.optimizer.iterations.numpy())


def names(folder):
    return sorted(path.name for path in folder.iterdir())


def test_the_last_two_backups_are_kept_and_the_newest_restores_weights_optimizer_and_epoch(interrupted):
    folder, weights, step = interrupted
    assert names(folder) == [f"state-0000000{i}.{kind}" for i in (1, 2) for kind in ("json", "npz")]
    model = make_model()
    assert backups.restore_backup(model, str(folder)) == 3
    assert int(model.optimizer.iterations.numpy()) == step == 12
    for restored, expected in zip(model.weights, weights):
        np.testing.assert_array_equal(restored.numpy(), expected)
    # Resumed, the run ends at the epoch it was asked for, then removes its backups.
    history = model.fit(*DATA, batch_size=8, epochs=5, initial_epoch=3, verbose=0,
                        callbacks=[callbacks.Backup(str(folder))])  # fmt: skip
    assert len(history.history["loss"]) == 2 and int(model.optimizer.iterations.numpy()) == 20
    assert not folder.exists()


def test_a_damaged_or_incomplete_newest_backup_is_named_and_the_previous_one_used(interrupted, caplog):
    folder, _, _ = interrupted
    newest = folder / "state-00000002.npz"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    model = make_model()
    with caplog.at_level(logging.WARNING, logger="keras_vit"):
        assert backups.restore_backup(model, str(folder)) == 2
    assert "state-00000002.json is damaged or incomplete" in caplog.text
    assert int(model.optimizer.iterations.numpy()) == 8  # the epoch and the weights of the same backup
    # A backup without its JSON (the run died before writing it) is never used: no weights without their epoch.
    (folder / "state-00000001.json").unlink()
    (folder / "state-00000002.json").write_text("{not json")
    with pytest.raises(backups.BackupError, match=r"No usable backup in .*state-00000002.json.*Delete .* to start"):
        backups.restore_backup(make_model(), str(folder))


def test_no_backup_means_epoch_zero_and_a_failed_save_keeps_the_previous_backups(interrupted, tmp_path, monkeypatch):
    assert backups.restore_backup(make_model(), str(tmp_path / "none")) == 0
    folder, _, _ = interrupted
    before = {name: (folder / name).read_bytes() for name in names(folder)}
    model = make_model()
    backups.restore_backup(model, str(folder))

    write = backups._write_variables

    def fail(model, path):  # Part of the archive written, then the disk is full.
        write(model, path)
        with open(path, "r+b") as f:
            f.truncate(100)
        raise OSError("No space left on device")

    monkeypatch.setattr(backups, "_write_variables", fail)
    backup = callbacks.Backup(str(folder))
    backup.set_model(model)
    with pytest.raises(OSError, match="No space left"):
        backup.save()
    assert {name: (folder / name).read_bytes() for name in names(folder)} == before


def test_a_backup_of_another_optimizer_or_model_is_not_restored(interrupted):
    """The weights alone would resume another run: nothing is assigned unless every variable fits."""
    folder, _, _ = interrupted
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(backups.BackupError, match=r"state-00000002.json .*it holds 14 variables; the model and its "
                                                  r"optimizer have 6: it is not this run's"):  # fmt: skip
        backups.restore_backup(model, str(folder))
    wider = keras.Sequential([keras.Input((4,)), keras.layers.Dense(9, activation="relu"), keras.layers.Dense(3)])
    wider.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.numpy() for w in wider.weights]
    with pytest.raises(backups.BackupError, match=r"its [\w/]+/kernel has the shape \(4, 8\); the model's "
                                                  r"[\w/]+/kernel has \(4, 9\)"):  # fmt: skip
        backups.restore_backup(wider, str(folder))
    for weight, value in zip(wider.weights, before):
        np.testing.assert_array_equal(weight.numpy(), value)


def test_a_backup_written_by_keras_save_weights_restores(interrupted):
    """A run interrupted under an earlier version, whose backups were `model.save_weights`' files, resumes."""
    folder, weights, step = interrupted
    model = make_model()
    backups.restore_backup(model, str(folder))
    record = json.loads((folder / "state-00000002.json").read_text())
    model.save_weights(folder / "state-00000003.weights.h5")
    (folder / "state-00000003.json").write_text(json.dumps({**record, "weights": "state-00000003.weights.h5"}))
    resumed = make_model()
    assert backups.restore_backup(resumed, str(folder)) == 3
    assert int(resumed.optimizer.iterations.numpy()) == step
    for restored, expected in zip(resumed.weights, weights):
        np.testing.assert_array_equal(restored.numpy(), expected)


def test_bfloat16_variables_are_saved_and_restored_bit_for_bit(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="bfloat16")])
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.optimizer.build(model.trainable_variables)
    model.layers[0].kernel.assign(np.random.default_rng(0).normal(size=(4, 3)))
    backups.write_state(model, str(tmp_path), {"epoch": 1, "step": 4})
    fresh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="bfloat16")])
    fresh.compile(keras.optimizers.Adam(1e-2), "mse")
    assert backups.restore_state(fresh, str(tmp_path)).step == 4
    assert keras.backend.standardize_dtype(fresh.layers[0].kernel.dtype) == "bfloat16"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(fresh.layers[0].kernel).view("u2"),
                                  keras.ops.convert_to_numpy(model.layers[0].kernel).view("u2"))  # fmt: skip


def test_each_backup_holds_the_values_at_its_writing_read_in_groups_of_bounded_size(tmp_path, monkeypatch):
    # 100 bytes: the first kernel (4 x 8 float32, 128 bytes) is a group alone, the next variables share groups.
    monkeypatch.setattr(backups, "_READ_BYTES", 100)
    model = make_model()
    model.optimizer.build(model.trainable_variables)
    variables = backups._saved_variables(model)
    for step in (1, 2):
        for i, variable in enumerate(variables):
            variable.assign(np.full(variable.shape, 10 * step + i, keras.backend.standardize_dtype(variable.dtype)))
        backups.write_state(model, str(tmp_path), {"epoch": 0, "step": step})
    fresh = make_model()
    assert backups.restore_state(fresh, str(tmp_path)).step == 2
    restored = backups._saved_variables(fresh)
    assert len(restored) == len(variables) > 4
    for i, variable in enumerate(restored):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), np.full(variable.shape, 20 + i))
