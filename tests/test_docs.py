"""Executes the examples in the docstrings, in README.md and in docs/*.md."""

import doctest
import importlib
import pathlib
import re

import keras
import pytest

from tests.builders import fenced_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The modules whose docstrings carry examples.
DOCTEST_MODULES = (
    "keras_vit.variants",
    "keras_vit.layers.embedding",
    "keras_vit.layers.attention",
    "keras_vit.layers.encoder",
    "keras_vit.layers.core",
    "keras_vit.model",
    "keras_vit.spec",
    "keras_vit.resnet",
    "keras_vit.flops",
    "keras_vit.visualize",
)

# The user's pages: README.md and docs/*.md, as paths relative to the repository root.
PAGES = ["README.md"] + sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))

# ```python blocks are executed; ```bash blocks are shell commands (the README's two are checked against
# .ci/run); ```text is output or plain text. Anything else (```py, ```Python) would go unexecuted unnoticed.
LANGUAGES = ("python", "bash", "text", "json")


# Pages whose examples take more than about 10 s on 2 CPU cores (an XLA-compiled training step).
SLOW_PAGES = {"docs/training.md"}


def pages_with_python():
    pages = [page for page in PAGES if any(lang == "python" for lang, _, _ in fenced_blocks((ROOT / page).read_text()))]
    return [pytest.param(page, marks=pytest.mark.slow) if page in SLOW_PAGES else page for page in pages]


@pytest.mark.parametrize("module_name", DOCTEST_MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, extraglobs={"keras": keras}, verbose=False)
    assert result.attempted > 0, f"{module_name} has no examples"
    assert result.failed == 0


def test_pages_have_examples():
    assert "README.md" in pages_with_python(), "README.md has no python example"
    assert SLOW_PAGES <= set(PAGES), f"SLOW_PAGES names pages that do not exist: {SLOW_PAGES - set(PAGES)}"
    assert len(PAGES) > 1, "docs/ has no page"


@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_are_labelled(page):
    text = (ROOT / page).read_text()
    blocks = fenced_blocks(text)
    assert text.count("```") == 2 * len(blocks), f"{page}: a fence is not closed or not at the start of a line"
    for language, line, _ in blocks:
        assert language in LANGUAGES, f"{page}:{line}: a ```{language} block; expected one of {LANGUAGES}"


@pytest.mark.parametrize("page", pages_with_python())
def test_python_examples_run(page, tmp_path, monkeypatch):
    """Runs every ```python block of the page, each in a fresh namespace, from an empty folder."""
    path = ROOT / page
    text = path.read_text()
    blocks = [(line, code) for language, line, code in fenced_blocks(text) if language == "python"]
    monkeypatch.chdir(tmp_path)
    ran = 0
    try:
        for line, code in blocks:
            # Padded so that a traceback gives the line numbers of the page.
            exec(compile("\n" * (line - 1) + code, str(path), "exec"), {"__name__": "__main__"})
            keras.mixed_precision.set_global_policy("float32")
            ran += 1
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert ran >= 1
    assert ran == len(re.findall(r"^```python$", text, flags=re.M)), f"{page}: a python block was not run"


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert len(commands) == 2
    install_and_test = commands[1]
    assert "pytest" in install_and_test and install_and_test in ci


def test_readme_is_a_users_page_whose_versions_are_the_tested_ones():
    """At most 250 lines (the details are in docs/), and the lowest TensorFlow it names is the one CI tests."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 250, f"README.md has {readme.count(chr(10))} lines; move details to docs/"
    named = re.search(r"TensorFlow >= (\d+\.\d+)", readme)
    tested = re.search(r'tensorflow-cpu==(\d+\.\d+)\.\*', (ROOT / ".ci" / "run").read_text())
    assert named and tested, "README.md names no 'TensorFlow >= X.Y', or .ci/run installs no tensorflow-cpu==X.Y.*"
    assert named.group(1) == tested.group(1), (named.group(0), tested.group(0))
