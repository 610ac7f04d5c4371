"""Files written by an earlier keras_vit load into today's: each case of tests/fixtures/saved (written once by
`python -m tests.fixtures.saved.write`, kept as they were) gives the logits it gave when written, through its
`.keras` file, its `.weights.h5` loaded into a model built today and its training backup restored into one."""

import os

import keras
import numpy as np
import pytest

from keras_vit import backups
from tests.fixtures.saved import write

CASES = sorted(write.CASES)


def _expected(case):
    with np.load(os.path.join(write.HERE, case, "expected.npz")) as saved:
        return saved["images"], saved["logits"]


def test_every_case_has_its_files():
    assert CASES == sorted(name for name in os.listdir(write.HERE) if os.path.isdir(os.path.join(write.HERE, name))
                           and name != "__pycache__")  # fmt: skip


@pytest.mark.slow  # a model loaded and two built per case: about 3 s each
@pytest.mark.parametrize("case", CASES)
def test_a_saved_model_its_weights_and_its_backup_load_with_the_logits_they_gave(case):
    images, logits = _expected(case)
    folder = os.path.join(write.HERE, case)
    loaded = keras.saving.load_model(os.path.join(folder, "model.keras"))
    today = write.build(case)
    assert loaded.spec == today.spec
    assert [w.path for w in loaded.weights] == [w.path for w in today.weights]
    np.testing.assert_allclose(loaded.predict(images, verbose=0), logits, rtol=1e-5, atol=1e-5)
    assert int(loaded.optimizer.iterations.numpy()) == 1
    # The weights file into a model built today (its optimizer built, so that its state loads too).
    assert np.abs(today.predict(images, verbose=0) - logits).max() > 1e-3  # Not the trained weights yet.
    today.optimizer.build(today.trainable_variables)
    today.load_weights(os.path.join(folder, "model.weights.h5"))
    np.testing.assert_allclose(today.predict(images, verbose=0), logits, rtol=1e-5, atol=1e-5)
    assert int(today.optimizer.iterations.numpy()) == 1
    # The training backup, restored as a resumed run does.
    resumed = write.build(case)
    assert backups.restore_position(resumed, os.path.join(folder, "backup")) == (1, 1)
    np.testing.assert_allclose(resumed.predict(images, verbose=0), logits, rtol=1e-5, atol=1e-5)
    assert int(resumed.optimizer.iterations.numpy()) == 1


def test_a_token_pooling_config_in_its_earlier_form_loads():
    """`prefix_tokens` was `skip` in the configs of earlier files."""
    from keras_vit.layers import TokenPooling

    earlier = {key: value for key, value in TokenPooling("gap").get_config().items() if key != "prefix_tokens"}
    pooling = TokenPooling.from_config({**earlier, "skip": 2})
    assert pooling.prefix_tokens == 2 and "skip" not in pooling.get_config()
