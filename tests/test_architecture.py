"""The shape of the code: imports point one way, private names stay private, modules stay readable.

The import graph is read from the source with `ast`, imports inside functions included, so a lazy import
that closes a circle is found as well as a top-level one.
"""

import ast
import pathlib

import pytest

from tests.conftest import ROOT

ROOT_PATH = pathlib.Path(ROOT)
PACKAGES = ("keras_vit", "experiments")
MAX_LINES = 600


def module_files():
    """{dotted module name: path} for every module of the library and the jobs."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT_PATH / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT_PATH).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def resolve_from(module, is_package, node):
    """The absolute module an ImportFrom node imports from."""
    if not node.level:
        return node.module
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module, path, known):
    """[(imported module, line, [names imported from it])] for every import of a known module."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.append((alias.name, node.lineno, []))
        elif isinstance(node, ast.ImportFrom):
            source = resolve_from(module, path.name == "__init__.py", node)
            if source not in known:
                continue
            names = []
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    found.append((submodule, node.lineno, []))
                else:
                    names.append(alias.name)
            if names:
                found.append((source, node.lineno, names))
    return found


def import_graph():
    modules = module_files()
    return {
        module: {target for target, _, _ in imports(module, path, modules) if target != module}
        for module, path in modules.items()
    }


def find_cycle(graph):
    """One cycle as a list of modules [a, b, ..., a], or None."""
    state = {}
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_sees_a_circle_and_a_line():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_sees_lazy_imports():
    graph = import_graph()
    # keras_vit.training imports TensorFlow's pieces lazily but keras_vit modules at the top; the public
    # API imports every unit; each edge found here is a real import in the source.
    assert "keras_vit.model" in graph["keras_vit"]
    assert any(target.startswith("keras_vit.kernels") for target in graph["keras_vit.layers.attention"])


def test_no_import_cycle_among_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_library_never_imports_the_jobs():
    graph = import_graph()
    wrong = {m: sorted(t for t in ts if t.startswith("experiments")) for m, ts in graph.items()}
    assert not {m: t for m, t in wrong.items() if m.startswith("keras_vit") and t}


def module_aliases(module, is_package, tree, known):
    """{local name: module} for the names a module binds to other known modules."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = resolve_from(module, is_package, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def private_uses(module, path, known):
    """[(line, text)] where `module` uses a `_private` name of another module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    uses = []
    for source, line, names in imports(module, path, known):
        for name in names:
            if name.startswith("_") and source != module:
                uses.append((line, f"from {source} import {name}"))
    aliases = module_aliases(module, path.name == "__init__.py", tree, known)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        chain = dotted(node)
        if not chain or chain[0] not in aliases:
            continue
        target = ".".join([aliases[chain[0]]] + chain[1:-1])
        if target in known and target != module:
            uses.append((node.lineno, ".".join(chain)))
    return uses


def test_private_use_is_found(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(
        "from keras_vit import compat\n"
        "from keras_vit.kernels import _hidden, attention\n"
        "import keras_vit.kernels.policy as policy\n"
        "compat._secret()\n"
        "policy._rule\n"
        "compat.public()\n"
        "self._own = 1\n"
    )
    uses = private_uses("probe", path, module_files())
    assert sorted(text for _, text in uses) == [
        "compat._secret",
        "from keras_vit.kernels import _hidden",
        "policy._rule",
    ]


def test_no_module_uses_another_modules_private_names():
    known = module_files()
    found = [
        f"{path.relative_to(ROOT_PATH)}:{line}: {text}"
        for module, path in known.items()
        for line, text in private_uses(module, path, known)
    ]
    assert not found, "private names used across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_600_lines(package):
    long = {
        str(path.relative_to(ROOT_PATH)): count
        for module, path in module_files().items()
        if module.split(".")[0] == package and (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def imported_modules(path):
    """The modules a file imports (lazy imports included), as dotted names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def test_no_test_module_imports_another():
    """What tests share lives in modules that hold no tests (tests/builders.py, tests/numpy_vit.py, ...)."""
    found = {
        path.name: sorted({name for name in imported_modules(path) if name.startswith("tests.test_")})
        for path in sorted((ROOT_PATH / "tests").glob("*.py"))
    }
    found = {name: modules for name, modules in found.items() if modules}
    assert not found, f"test modules imported by other modules of tests/: {found}"


def shared_fixtures_in_tests():
    """{name: its arguments} of the fixtures in tests/ declared with scope "module" or "session"."""
    names = {}
    for path in sorted((ROOT_PATH / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                scopes = [
                    keyword.value.value
                    for keyword in getattr(decorator, "keywords", [])
                    if keyword.arg == "scope" and isinstance(keyword.value, ast.Constant)
                ]
                if scopes and scopes[0] in ("module", "session", "package"):
                    names[node.name] = {argument.arg for argument in node.args.args}
    return names


def test_every_shared_fixture_keeps_its_tests_on_one_worker():
    from tests import scheduling

    found = shared_fixtures_in_tests()
    assert "digits_main_job" in found and "digits_model" in found["digits_exports"]
    shared = set(scheduling.SHARED_FIXTURES) | {"environment_children"}  # The children: grouped by environment.
    # A fixture built on a listed one (test_export's digits_exports on digits_model) is grouped with it.
    missing = {name for name, arguments in found.items() if name not in shared and not arguments & shared}
    assert not missing, f"module- or session-scoped fixtures missing from scheduling.SHARED_FIXTURES: {missing}"


@pytest.mark.slow
def test_tests_that_share_a_fixture_run_on_one_worker(tmp_path):
    """The suite's grouping under `-n 2 --dist loadgroup`, on stand-in tests: a session fixture used by
    tests in two files runs once (pytest-xdist's groups have silently stopped working before)."""
    import os
    import subprocess
    import sys

    log = tmp_path / "log"
    (tmp_path / "conftest.py").write_text(
        "import os, pytest\n"
        "from tests.scheduling import pytest_collection_modifyitems  # the suite's grouping\n"
        "@pytest.fixture(scope='session')\n"
        "def digits_main_job():\n"
        f"    open({str(log)!r}, 'a').write('job ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
    )
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "import os, time\n"
            "def test_uses_the_job(digits_main_job):\n"
            f"    open({str(log)!r}, 'a').write('test ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
            + "".join(f"def test_other_{i}():\n    time.sleep(0.2)\n" for i in range(4))
        )
    env = dict(os.environ, PYTHONPATH=str(ROOT_PATH))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
         "-n", "2", "--dist", "loadgroup", "-q", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = log.read_text().split("\n")
    jobs = [line for line in lines if line.startswith("job")]
    tests = [line for line in lines if line.startswith("test")]
    assert len(jobs) == 1 and len(tests) == 2, lines
    assert {line.split()[1] for line in tests} == {jobs[0].split()[1]}, lines


def keras_method_names():
    """The names of the methods of Keras' models and optimizers (properties and data excluded)."""
    import inspect

    import keras

    names = set()
    for cls in (keras.Model, keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer):
        for name in dir(cls):
            static = inspect.getattr_static(cls, name, None)
            if inspect.isfunction(static) or isinstance(static, (classmethod, staticmethod)):
                names.add(name)
    return names


def method_assignments(path, methods):
    """[(line, text)] where the code at `path` assigns, deletes or `setattr`s an attribute named as one of
    `methods`, on any object: a model's or optimizer's method replaced at run time."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif isinstance(target, ast.Attribute) and target.attr in methods:
                found.append((node.lineno, ast.unparse(target)))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in methods
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_method_assignment_is_found(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(
        "model.train_step = lambda data: data\n"
        "setattr(optimizer, 'apply_gradients', catch)\n"
        "del model.train_step\n"
        "Trainer.fit, x = fit, 1\n"
        "model.train_function = None\n"  # Keras' cache of the traced step: an attribute, not a method.
        "layer.trainable = False\n"  # A property.
        "setattr(self, name, kernel)\n"
        "model.get_layer('head').trainable = False\n"
    )
    found = method_assignments(path, keras_method_names())
    assert sorted(line for line, _ in found) == [1, 2, 3, 4], found


def test_no_method_of_a_model_or_optimizer_is_replaced_outside_compat():
    """Training behaviour goes through Keras' documented hooks (`train_step` and the other methods a subclass
    overrides); what must patch Keras lives in keras_vit.compat with its canary."""
    methods = keras_method_names()
    assert {"train_step", "apply_gradients", "scale_loss", "stateless_apply", "fit"} <= methods
    found = [
        f"{path.relative_to(ROOT_PATH)}:{line}: {text}"
        for module, path in module_files().items()
        # The configs are ConfigDicts, whose fields (`config.export`) may share a method's name.
        if not module.startswith(("keras_vit.compat", "experiments.configs"))
        for line, text in method_assignments(path, methods)
    ]
    assert not found, "methods of models or optimizers replaced at run time:\n" + "\n".join(found)
