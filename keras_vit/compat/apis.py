"""What the compat entries share: the versions they were written for, finding a private API, reporting what
is missing, and the registry of each entry's check (`CHECKS`)."""

import importlib
import inspect
import types

import keras

WRITTEN_FOR = {"keras": "3.15", "tensorflow": "2.21"}
# The oldest versions the canaries run against (.ci/run's second environment: TensorFlow 2.20, the newest
# `tensorflow-tpu`); the entries work there too. Older ones are refused by keras_vit.requirements.
CHECKED_FROM = {"keras": "3.15", "tensorflow": "2.20"}

# {entry name: a function listing what the entry relies on that is missing}; each module of keras_vit.compat
# adds its entries.
CHECKS = {}


class PrivateApiError(RuntimeError):
    """A private Keras or TensorFlow API that a `keras_vit.compat` entry relies on is missing or changed."""


def installed_versions():
    """{"keras": ..., "tensorflow": ...}: the installed versions ("not installed" for an absent TensorFlow)."""
    try:
        import tensorflow as tf

        tensorflow_version = tf.__version__
    except ImportError:
        tensorflow_version = "not installed"
    return {"keras": keras.version(), "tensorflow": tensorflow_version}


def versions_sentence():
    found = installed_versions()
    return (
        f"written for Keras {WRITTEN_FOR['keras']} and TensorFlow {WRITTEN_FOR['tensorflow']}, "
        f"found Keras {found['keras']} and TensorFlow {found['tensorflow']}"
    )


def lookup(module_name, qualified_name):
    """(the object, None), or (None, why it cannot be found)."""
    try:
        found = importlib.import_module(module_name)
    except ImportError as error:
        return None, f"{module_name} cannot be imported ({error})"
    for part in qualified_name.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            return None, f"{module_name}.{qualified_name} does not exist"
    return found, None


def parameters_problem(function, name, expected, exact):
    """None when `function` takes `expected` (exactly, or as its leading parameters)."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return f"{name} has no signature to check"
    matches = parameters == list(expected) if exact else parameters[: len(expected)] == list(expected)
    if matches:
        return None
    wanted = "exactly" if exact else "starting with"
    return f"{name} takes ({', '.join(parameters)}); expected parameters {wanted} ({', '.join(expected)})"


def names_used(function):
    """The global and attribute names `function`'s code (its nested functions included) refers to."""
    if function is not None:
        function = inspect.unwrap(function)  # Past decorators such as Keras' traceback filter.
    code = getattr(function, "__code__", None)
    pending, names = [code] if code is not None else [], set()
    while pending:
        code = pending.pop()
        names.update(code.co_names)
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def function_problems(module_name, qualified_name, expected, exact=False):
    function, problem = lookup(module_name, qualified_name)
    if problem:
        return [problem]
    if not callable(function):
        return [f"{module_name}.{qualified_name} is not callable"]
    if expected is None:  # A compiled function: no Python signature to compare.
        return []
    problem = parameters_problem(function, f"{module_name}.{qualified_name}", expected, exact)
    return [problem] if problem else []


def api_problems(entry):
    """What `entry` relies on that the installed Keras and TensorFlow lack or changed; [] when all is there."""
    if entry not in CHECKS:
        raise ValueError(f"`entry` must be one of {tuple(CHECKS)}. Received: entry={entry!r}")
    return CHECKS[entry]()


def require(entry):
    problems = api_problems(entry)
    if problems:
        raise PrivateApiError(
            f"keras_vit.compat.{entry} relies on private APIs that changed: {'; '.join(problems)} "
            f"({versions_sentence()})."
        )


def resolve(entry, module_name, qualified_name):
    """The private object `entry` calls, or PrivateApiError when it or anything else `entry` needs is off."""
    require(entry)
    return lookup(module_name, qualified_name)[0]

