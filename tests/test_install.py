"""The installed environment: one TensorFlow, of a supported version, and a clear error without one."""

import os
import subprocess
import sys
from importlib import metadata

import pytest

from keras_vit import requirements
from tests.conftest import ROOT


def test_exactly_one_tensorflow_build_is_installed():
    # Installing the library next to `tensorflow-cpu` or `tensorflow-tpu` must not pull `tensorflow`
    # in beside it (two builds overwrite each other's files in site-packages).
    found = requirements.installed_tensorflows()
    assert len(found) == 1, f"expected one TensorFlow distribution, found {found}"
    (version,) = found.values()
    assert requirements.version_tuple(version) >= requirements.MINIMUM_TENSORFLOW, found


def test_the_library_requires_no_tensorflow_distribution_by_name():
    requires = metadata.requires("keras-vit") or []
    unconditional = [r for r in requires if "extra ==" not in r]
    named = [r for r in unconditional if r.split(";")[0].strip().lower().startswith(("tensorflow>", "tensorflow="))]
    assert not named and any(r.startswith("keras") for r in unconditional), requires
    assert any(r.startswith("tensorflow>=2.20") and 'extra == "tensorflow"' in r for r in requires), requires


def run_without_tensorflow(code, backend):
    """Runs `code` in a child whose `import tensorflow` fails as it does where no build is installed."""
    hide = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorflow' or name.startswith('tensorflow.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'tensorflow'\", name='tensorflow')\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    env = dict(os.environ, KERAS_BACKEND=backend)
    return subprocess.run(
        [sys.executable, "-c", hide + code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_without_tensorflow_the_error_names_the_builds():
    result = run_without_tensorflow("import keras_vit", "tensorflow")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: keras_vit on Keras' TensorFlow backend"), result.stderr[-2000:]
    for build in ("tensorflow-cpu", "tensorflow-tpu", "keras-vit[tensorflow]", "KERAS_BACKEND=jax"):
        assert build in last, last


@pytest.mark.environment("jax_without_tensorflow")
def test_the_model_runs_on_jax_without_tensorflow_and_the_input_pipeline_says_what_it_needs():
    import numpy as np

    import keras_vit

    model = keras_vit.build_vit("testing", image_size=16, num_classes=3)
    assert model.predict(np.zeros((1, 16, 16, 3), "uint8"), verbose=0).shape == (1, 3)
    with pytest.raises(ImportError) as raised:
        import keras_vit.data  # noqa: F401
    message = str(raised.value)
    assert message.startswith("keras_vit.data needs TensorFlow 2.20 or newer") and "tensorflow-tpu" in message
    assert "tensorflow" not in sys.modules
