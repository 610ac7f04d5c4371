"""Quantizing a model at the cost of its arithmetic: one garbage collection for all the kernels it replaces, not one
per kernel."""

import contextlib
import gc
import threading

from keras_vit.compat.apis import CHECKS, lookup, names_used

_DELATTR = ("keras.src.layers.layer", "Layer.__delattr__")
_LOCK = threading.Lock()
_OWNERS = {}  # {thread id: depth of one_collection_for_deleted_variables in that thread}
_ORIGINAL = None  # gc.collect as it was before the first thread entered


def _collect(*args, **kwargs):
    """gc.collect for the threads outside `one_collection_for_deleted_variables`; nothing for those in it."""
    if threading.get_ident() in _OWNERS:
        return 0
    return _ORIGINAL(*args, **kwargs)


@contextlib.contextmanager
def one_collection_for_deleted_variables():
    """Runs the body with Keras' collection after each deleted variable put off to one `gc.collect()` at its end.

    Written for Keras 3.15 with TensorFlow 2.21.  `keras.src.layers.layer.Layer.__delattr__` runs a full
    `gc.collect()` each time a variable attribute is deleted, so that the variable's buffer leaves the device at
    once; quantizing deletes every float kernel it replaces (Keras' `Dense`, `EinsumDense` and
    `keras_vit.layers.quantization`), and a full collection costs as much as the process holds objects: most of
    the time of quantizing a ViT-B/16 in a process that has loaded TensorFlow.  In the body, `gc.collect` (the
    `gc` module's attribute, which that method looks up at each call) does nothing in this thread and is
    Python's own in the others; at the end, the one collection frees every deleted kernel.  Nested and
    concurrent bodies are allowed.

    A faster path: where that method no longer collects (the canary in tests/test_compat.py fails then), the
    body runs as it would without it, and so does the collection at the end.
    """
    global _ORIGINAL
    me = threading.get_ident()
    with _LOCK:
        if not _OWNERS:
            _ORIGINAL = gc.collect
            gc.collect = _collect
        _OWNERS[me] = _OWNERS.get(me, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _OWNERS[me] -= 1
            if not _OWNERS[me]:
                del _OWNERS[me]
            original = _ORIGINAL
            if not _OWNERS:
                gc.collect = _ORIGINAL
        if me not in _OWNERS:
            original()


def _delattr_problems():
    method, problem = lookup(*_DELATTR)
    if problem:
        return [problem]
    if "collect" not in names_used(method):
        return [f"{'.'.join(_DELATTR)} no longer calls gc.collect: one_collection_for_deleted_variables has nothing "
                "to put off"]  # fmt: skip
    return []


CHECKS["one_collection_for_deleted_variables"] = _delattr_problems
