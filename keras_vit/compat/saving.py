"""`.keras` saves at the cost Keras means them to have: the attribute skip sets its saving computes once per
type kept where its lookup reads them."""

from keras_vit.compat.apis import CHECKS, function_problems, lookup

_SKIPSET = ("keras.src.saving.saving_lib", "get_attr_skipset")
_GLOBAL_STATE = "keras.src.backend.common.global_state"
_STORED, _READ = "saving_attr_skipset_", "saving_attr_skiplist_"
_TYPES = ("Operation", "Layer", "Functional", "Sequential", "Metric", "Optimizer", "Loss", "Cross", "Feature")


def keep_saving_skipsets():
    """Lets the `.keras` saves that follow in this thread find the attribute skip sets the earlier ones computed.

    Written for Keras 3.15 with TensorFlow 2.21.  Saving walks every layer, metric and optimizer, skipping the
    attributes that `keras.src.saving.saving_lib.get_attr_skipset(obj_type)` names: a set per type, made from
    fresh reference objects (a Layer; a Metric and a CompileMetrics; an Optimizer).  That function stores the
    set in Keras' global state (`keras.src.backend.common.global_state`, one per thread) under
    "saving_attr_skipset_<type>" but looks for it under "saving_attr_skiplist_<type>", so it makes the set
    again for every object it walks: about a third of a small model's save.  This copies each
    stored set to the name the lookup reads; the sets do not depend on the object.  After
    `keras.backend.clear_session()` (which clears that state) the next save makes them again, and the next call
    keeps them.

    A faster path: does nothing when those private APIs are missing (the canary in tests/test_compat.py still
    fails then), and nothing more once Keras finds its own sets.
    """
    get, _ = lookup(_GLOBAL_STATE, "get_global_attribute")
    put, _ = lookup(_GLOBAL_STATE, "set_global_attribute")
    if not (callable(get) and callable(put)):
        return
    for obj_type in _TYPES:
        stored = get(_STORED + obj_type)
        if stored is not None and get(_READ + obj_type) is None:
            put(_READ + obj_type, stored)


def _skipset_problems():
    problems = function_problems(*_SKIPSET, ("obj_type",), exact=True)
    problems += function_problems(_GLOBAL_STATE, "get_global_attribute", ("name",))
    problems += function_problems(_GLOBAL_STATE, "set_global_attribute", ("name", "value"), exact=True)
    function, _ = lookup(*_SKIPSET)
    constants = set(getattr(getattr(function, "__code__", None), "co_consts", ()))
    if not problems and not {_STORED, _READ} <= constants:
        problems.append(f"{'.'.join(_SKIPSET)} no longer stores its sets under {_STORED!r} and reads {_READ!r}")
    return problems


CHECKS["keep_saving_skipsets"] = _skipset_problems
