import pathlib

import keras
import numpy as np
import pytest

from keras_vit import training

ROOT = pathlib.Path(__file__).resolve().parents[1]

@pytest.mark.environment("two_cpus")
def test_global_clipnorm_clips_the_summed_gradient_across_replicas(two_replicas):
    import tensorflow as tf

    strategy = two_replicas
    results = {}
    for name, cls in (("ours", training.SGD), ("keras", keras.optimizers.SGD)):
        with strategy.scope():
            variable = keras.Variable([0.0, 0.0])
            optimizer = cls(1.0, global_clipnorm=1.0)
            optimizer.build([variable])

        def step(optimizer=optimizer, variable=variable):
            index = tf.distribute.get_replica_context().replica_id_in_sync_group
            # Replica 0 sees (3, 0), replica 1 sees (0, 4): the summed gradient (3, 4) has norm 5.
            grad = tf.where(tf.equal(index, 0), tf.constant([3.0, 0.0]), tf.constant([0.0, 4.0]))
            optimizer.apply_gradients([(grad, variable)])

        strategy.run(tf.function(step))
        results[name] = variable.numpy()
    # One device with the same global gradient (3, 4): clipped to norm 1, step -(0.6, 0.8).
    np.testing.assert_allclose(results["ours"], [-0.6, -0.8], atol=1e-6)
    # Stock Keras 3.15 clips each replica's gradient on its own: a different update.
    assert not np.allclose(results["keras"], [-0.6, -0.8], atol=1e-3)


def decayed_by(strategy, optimizer_class):
    """Four variables after three steps of `optimizer_class` (AdamW, weight decay 0.1, the warm-up and cosine
    schedule) under `strategy`, and how many times the step's graph computes a cosine (the schedule)."""
    import tensorflow as tf

    with strategy.scope():
        variables = [keras.Variable(np.linspace(-1.0, 1.0, 3, dtype="float32") * (i + 1)) for i in range(4)]
        optimizer = optimizer_class(training.learning_rate_schedule(1e-2, 100, 2), weight_decay=0.1)
        optimizer.build(variables)

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply([tf.fill((3,), 0.5)] * len(variables), variables))

    for _ in range(3):
        step()
    graph = step.get_concrete_function().graph.as_graph_def()  # Its functions too (the schedule's conditions).
    nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
    cosines = sum(node.op == "Cos" for node in nodes)
    return [v.numpy() for v in variables], cosines


def check_weight_decay_is_keras_with_one_schedule(strategy):
    ours, our_cosines = decayed_by(strategy, training.AdamW)
    theirs, their_cosines = decayed_by(strategy, keras.optimizers.AdamW)
    for mine, reference in zip(ours, theirs):
        np.testing.assert_array_equal(mine, reference)  # The same operations: bit for bit.
    replicas = strategy.num_replicas_in_sync
    # Per replica, the schedule once for the update and once for the decay; Keras' once more per variable.
    assert our_cosines == 2 * replicas and their_cosines == (1 + len(ours)) * replicas, (our_cosines, their_cosines)


def test_the_weight_decay_is_keras_with_the_schedule_computed_once():
    import tensorflow as tf

    check_weight_decay_is_keras_with_one_schedule(tf.distribute.get_strategy())


@pytest.mark.environment("two_cpus")
def test_the_weight_decay_is_keras_with_the_schedule_computed_once_on_each_of_two_replicas(two_replicas):
    check_weight_decay_is_keras_with_one_schedule(two_replicas)


def test_warmup_then_cosine_and_linear_decay():
    cosine = training.learning_rate_schedule(1e-3, total_steps=100, warmup_steps=10)
    linear = training.learning_rate_schedule(1e-3, total_steps=100, warmup_steps=10, decay="linear")
    for schedule in (cosine, linear):
        rates = [float(schedule(step)) for step in (0, 5, 10, 55, 100)]
        np.testing.assert_allclose(rates[:3], [0.0, 5e-4, 1e-3], atol=1e-9)
        assert rates[4] == pytest.approx(0.0, abs=1e-9)
    assert float(cosine(55)) == pytest.approx(5e-4, rel=1e-5)  # half-way through the cosine
    assert float(linear(55)) == pytest.approx(5e-4, rel=1e-5)
    assert float(cosine(30)) > float(linear(30))


def test_recipes_and_their_errors(tmp_path):
    adamw = training.make_optimizer("adamw", 1e-3, 100, 10, weight_decay=0.05)
    assert isinstance(adamw, keras.optimizers.AdamW) and adamw.weight_decay == 0.05
    assert adamw.global_clipnorm == 1.0
    sgd = training.make_optimizer("sgd", 0.03, 100, 5)
    assert isinstance(sgd, keras.optimizers.SGD) and sgd.momentum == 0.9
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        training.make_optimizer("lamb", 1e-3, 100, 10)
    with pytest.raises(ValueError, match="no weight decay"):
        training.make_optimizer("sgd", 1e-3, 100, 10, weight_decay=1e-4)
    with pytest.raises(ValueError, match="warmup_steps=100, total_steps=100"):
        training.make_optimizer("adamw", 1e-3, 100, 100)
    # The optimizers and schedules survive a .keras round trip.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=training.make_optimizer("adamw", 1e-3, 100, 10, decay="linear"), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    model.save(tmp_path / "m.keras")
    restored = keras.saving.load_model(tmp_path / "m.keras")
    assert isinstance(restored.optimizer, training.AdamW)
    schedule = restored.optimizer.get_config()["learning_rate"]  # the schedule itself, not its last value
    assert schedule["registered_name"] == "keras_vit>WarmupLinearDecay", schedule
    assert schedule["config"] == {"base_rate": 1e-3, "total_steps": 100, "warmup_steps": 10}
    # One step taken: the restored schedule gives the warm-up's rate at step 1.
    assert int(restored.optimizer.iterations) == 1
    assert float(restored.optimizer.learning_rate) == pytest.approx(1e-4)


def test_resolve_jit_compile(monkeypatch):
    from keras_vit import compat
    from keras_vit.training import resolve_jit_compile

    assert resolve_jit_compile("on") is True and resolve_jit_compile("off") is False
    assert resolve_jit_compile(True) is True and resolve_jit_compile(False) is False
    # On a CPU with TensorFlow and oneDNN: XLA to train in float32, oneDNN (no XLA) otherwise.
    monkeypatch.setattr(compat, "onednn_enabled", lambda: True)
    assert resolve_jit_compile("auto", "float32") is True
    assert resolve_jit_compile("auto", "float32", training=False) is False
    assert resolve_jit_compile("auto", "mixed_bfloat16") is False
    assert resolve_jit_compile("auto", "mixed_float16") is False
    # Without oneDNN: XLA for everything.
    monkeypatch.setattr(compat, "onednn_enabled", lambda: False)
    for precision in ("float32", "mixed_bfloat16", "mixed_float16"):
        assert resolve_jit_compile("auto", precision) is True
        assert resolve_jit_compile("auto", precision, training=False) is True
    with pytest.raises(ValueError, match=r"one of \('auto', 'on', 'off'\).*Received: jit_compile='yes'"):
        resolve_jit_compile("yes")


def test_resolve_jit_compile_asks_the_platform_policy(monkeypatch):
    """"auto" reads the platform where the call is made (`keras_vit.kernels.policy.device()`): a GPU or TPU
    gets XLA whatever the precision, and the same call back on the CPU gets the CPU's rule."""
    from keras_vit import compat
    from keras_vit.kernels import policy
    from keras_vit.training import resolve_jit_compile

    monkeypatch.setattr(compat, "onednn_enabled", lambda: True)
    cases = [(precision, training) for precision in ("float32", "mixed_bfloat16") for training in (True, False)]
    on_cpu = [resolve_jit_compile("auto", *case) for case in cases]
    assert on_cpu == [True, False, False, False]
    for kind in ("gpu", "tpu"):
        with monkeypatch.context() as patch:
            patch.setattr(policy, "default_device", lambda backend=None, kind=kind: kind)
            assert [resolve_jit_compile("auto", *case) for case in cases] == [True] * 4
    assert [resolve_jit_compile("auto", *case) for case in cases] == on_cpu


@pytest.mark.parametrize("strategy", ["none", pytest.param("two_replicas", marks=pytest.mark.environment("two_cpus"))])
def test_fit_builds_the_optimizer_before_tracing_the_step_and_trains_as_keras_fit(strategy, request):
    """On TensorFlow, ViT.fit builds an unbuilt optimizer eagerly (in Keras' fit, without a strategy, it is
    built inside the first trace of the step); the weights after fit are Keras' fit's, bit for bit."""
    import contextlib

    import tensorflow as tf

    from keras_vit import TrainingSteps, build_vit
    from keras_vit.testing import random_images

    replicas = request.getfixturevalue("two_replicas") if strategy != "none" else None
    images, labels = random_images((8, 16, 16, 3)), np.arange(8) % 3
    trained = {}
    for name in ("ours", "keras"):
        keras.utils.set_random_seed(3)
        with replicas.scope() if replicas else contextlib.nullcontext():
            model = build_vit("testing", image_size=16, num_classes=3, patch_size=4)
            model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="sparse_categorical_crossentropy")
        made = []

        def creator(next_creator, made=made, **kwargs):
            made.append(tf.inside_function())
            return next_creator(**kwargs)

        fit = model.fit if name == "ours" else super(TrainingSteps, model).fit
        with tf.variable_creator_scope(creator):
            fit(images, labels, epochs=1, batch_size=4, shuffle=False, verbose=0)
        trained[name] = (made, model.get_weights())
    made, weights = trained["ours"]
    assert len(made) >= 2 * len(weights) and not any(made)  # AdamW's two slots a weight, none in a trace.
    if strategy == "none":
        assert any(trained["keras"][0])  # Keras' own fit builds it in the trace: what the test is about.
    for ours, theirs in zip(weights, trained["keras"][1]):
        np.testing.assert_array_equal(ours, theirs)
