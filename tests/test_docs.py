"""Executes the examples in the docstrings and in README.md."""

import doctest
import pathlib
import re

import keras
import pytest

import keras_vit.layers
import keras_vit.model
import keras_vit.resnet
import keras_vit.variants

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", [keras_vit.variants, keras_vit.layers, keras_vit.model, keras_vit.resnet])
def test_docstring_examples(module):
    result = doctest.testmod(module, extraglobs={"keras": keras}, verbose=False)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0


def test_readme_python_examples():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python example"
    try:
        for block in blocks:
            exec(compile(block, "README.md", "exec"), {})
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert len(commands) == 2
    install_and_test = commands[1]
    assert "pytest" in install_and_test and install_and_test in ci
