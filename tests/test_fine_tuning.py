"""Gradient accumulation, the moving average of the weights (EMA) and layer-wise learning-rate decay:
each against what it stands for (the large batch, a NumPy average, Keras' AdamW at the scaled rate),
alone and together, with clipping, mixed precision, MixUp/CutMix, two replicas and a resumed run."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from keras_vit import backups, callbacks, training
from tests.builders import StopAfter

IMAGES = np.random.default_rng(0).integers(0, 256, size=(64, 16, 16, 3)).astype("uint8")
LABELS = np.eye(4, dtype="float32")[np.arange(64) % 4]


def make_model(*, ema_momentum=0.0, layer_decay=1.0, accumulation=1, mixup=0.0, cutmix=0.0, clip=0.05,
               weight_decay=0.1, steps=100, jit_compile=False, seed=0, built=True):
    """A small ViT compiled with the recipe's AdamW (tight clipping: it clips at every step).

    Its optimizer is built before `fit`, as Keras builds it under a strategy's scope (the training job's
    path): without a strategy Keras builds it inside `fit`'s first trace of the step, which then traces the
    step twice (and, with XLA and accumulation, compiles it again in the second epoch). `built=False` leaves
    the building to `fit`: test_layer_decay_survives_save_and_load and the uninterrupted run of
    test_a_resumed_run_with_everything_on_ends_as_the_uninterrupted_one run that path.
    """
    keras.utils.set_random_seed(seed)
    model = keras_vit.build_vit("testing", image_size=16, num_classes=4, head_kernel_initializer="glorot_uniform")
    optimizer = training.make_optimizer(
        "adamw", 1e-3, steps, 2, weight_decay=weight_decay, grad_clip_norm=clip,
        ema_momentum=ema_momentum, layer_decay=layer_decay, model=model,
    )
    model.compile(optimizer, keras.losses.CategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")], jit_compile=jit_compile)  # fmt: skip
    keras_vit.enable_batch_mixing(model, mixup_alpha=mixup, cutmix_alpha=cutmix, seed=seed)
    keras_vit.enable_gradient_accumulation(model, accumulation)
    if built:
        model.optimizer.build(model.trainable_variables)
    return model


def batches(batch_size):
    return tf.data.Dataset.from_tensor_slices((IMAGES, LABELS)).batch(batch_size, drop_remainder=True)


def weights(model):
    return [w.numpy() for w in model.weights]


def assert_same_weights(a, b, atol):
    assert len(a) == len(b)
    worst = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
    assert worst <= atol, worst


# === Gradient accumulation: the large batch's update ===


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True])
def test_accumulated_micro_batches_make_the_large_batch_update(jit_compile):
    large = make_model(mixup=0.8, cutmix=1.0, jit_compile=jit_compile)
    large_history = large.fit(batches(16), epochs=2, verbose=0, shuffle=False).history
    accumulated = make_model(mixup=0.8, cutmix=1.0, accumulation=4, jit_compile=jit_compile)
    history = accumulated.fit(batches(16), epochs=2, verbose=0, shuffle=False).history
    # One update per batch of 16: the same step count, schedule position and mixing draws.
    assert int(accumulated.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 8
    assert_same_weights(weights(accumulated), weights(large), atol=2e-6)
    # The logged loss and accuracy average every micro-batch: the large batch's figures.
    np.testing.assert_allclose(history["loss"], large_history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["accuracy"], large_history["accuracy"], rtol=1e-6)
    # And it trained: not the initial weights.
    assert_different = max(float(np.max(np.abs(x - y))) for x, y in zip(weights(large), weights(make_model())))
    assert assert_different > 1e-3


@pytest.mark.slow
def test_accumulation_under_loss_scaling(policy):
    policy("mixed_float16")  # Keras wraps the optimizer in a LossScaleOptimizer.
    large, accumulated = make_model(), make_model(accumulation=2)
    assert isinstance(accumulated.optimizer, keras.optimizers.LossScaleOptimizer)
    large.fit(batches(16), epochs=4, verbose=0, shuffle=False)
    accumulated.fit(batches(16), epochs=4, verbose=0, shuffle=False)
    # The first steps overflow at the initial loss scale (2 ** 15) and are skipped, in both runs alike.
    updates = int(accumulated.optimizer.iterations.numpy())
    assert updates == int(large.optimizer.iterations.numpy()) and updates >= 4
    # float16 activations: the micro-batches round otherwise than the large batch.
    assert_same_weights(weights(accumulated), weights(large), atol=2e-3)


def test_accumulation_refuses_what_it_cannot_split():
    model = make_model(accumulation=3)
    with pytest.raises(ValueError, match=r"multiple of 3\. Received a batch of 16"):
        model.fit(batches(16), epochs=1, verbose=0)
    for steps in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"`steps` must be an integer >= 1"):
            keras_vit.enable_gradient_accumulation(model, steps)
    keras_vit.enable_gradient_accumulation(model, 1)  # Off again: Keras' own step.
    assert model.gradient_accumulation_steps == 1 and "train_step" not in vars(model)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"Gradient accumulation needs .*keras_vit.TrainingSteps.*Received a keras"):
        keras_vit.enable_gradient_accumulation(plain, 2)


class AccumulatingSequential(keras_vit.TrainingSteps, keras.Sequential):
    """A Sequential model with keras_vit's training step (a user's own model)."""


def test_accumulation_sums_an_embeddings_sparse_gradients():
    def embedding_model(steps):
        keras.utils.set_random_seed(0)
        model = AccumulatingSequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
                                        keras.layers.Flatten(), keras.layers.Dense(2)])  # fmt: skip
        model.compile(keras.optimizers.SGD(0.1), keras.losses.MeanSquaredError(), jit_compile=False)
        keras_vit.enable_gradient_accumulation(model, steps)
        return model

    tokens = np.random.default_rng(0).integers(0, 10, (16, 3)).astype("int32")
    targets = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")
    large, accumulated = embedding_model(1), embedding_model(4)
    for model in (large, accumulated):
        model.fit(tokens, targets, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_same_weights(weights(accumulated), weights(large), atol=1e-6)


# === The moving average ===


class RecordTrained(keras.callbacks.Callback):
    """The trained (not averaged) weights after every step."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([w.numpy() for w in self.model.trainable_weights])


class RecordEpochEnd(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append([w.numpy() for w in self.model.trainable_weights])


@pytest.mark.slow
def test_the_moving_average_is_validated_checkpointed_and_kept_and_training_is_unchanged():
    momentum = 0.8
    model = make_model(ema_momentum=momentum)
    ema, trained, between, after = callbacks.EMAWeights(), RecordTrained(), RecordEpochEnd(), RecordEpochEnd()
    history = model.fit(batches(16), epochs=2, verbose=0, shuffle=False, validation_data=batches(32),
                        callbacks=[ema, between, ema.restorer(), after, trained]).history  # fmt: skip
    # The average of the trained weights, as Keras defines it: the first step's weights, then m * a + (1 - m) * w.
    average = trained.steps[0]
    for step in trained.steps[1:]:
        average = [momentum * a + (1 - momentum) * w for a, w in zip(average, step)]
    final = [w.numpy() for w in model.trainable_weights]
    assert_same_weights(final, average, atol=1e-6)
    # Callbacks between the two saw the average at the end of each epoch, the ones after the trained weights.
    assert_same_weights(between.seen[-1], average, atol=1e-6)
    assert_same_weights(after.seen[-1], trained.steps[-1], atol=0)
    # Validation was of the averaged model.
    x, y = next(iter(batches(32)))
    expected = keras.losses.CategoricalCrossentropy(from_logits=True)(y, model(x)).numpy()
    x2, y2 = list(batches(32))[1]
    expected = (expected + keras.losses.CategoricalCrossentropy(from_logits=True)(y2, model(x2)).numpy()) / 2
    assert history["val_loss"][-1] == pytest.approx(float(expected), rel=1e-5)
    # The swaps are exact: the trained weights are those of a run that never swapped.
    plain, plain_trained = make_model(ema_momentum=momentum), RecordTrained()
    plain.fit(batches(16), epochs=2, verbose=0, shuffle=False, callbacks=[plain_trained])
    assert_same_weights(trained.steps[-1], plain_trained.steps[-1], atol=0)


def test_ema_weights_needs_an_average_and_its_restorer_after_it():
    model = make_model()  # No moving average.
    with pytest.raises(ValueError, match="EMAWeights needs an optimizer that keeps a moving average"):
        model.fit(batches(16), epochs=1, verbose=0, callbacks=[callbacks.EMAWeights()])
    model, ema = make_model(ema_momentum=0.9), callbacks.EMAWeights()
    with pytest.raises(RuntimeError, match=r"`restorer\(\)` must be among fit's callbacks, after"):
        model.fit(batches(16), epochs=2, verbose=0, callbacks=[ema.restorer(), ema])


# === Layer-wise learning-rate decay ===


def test_layer_decay_scales_the_head_blocks_and_embeddings():
    model = keras_vit.build_vit("testing", image_size=16, num_classes=4, classifier="token")
    depth = sum(isinstance(layer, keras_vit.TransformerBlock) for layer in model.layers)
    scales = keras_vit.layer_decay_scales(model, 0.5)
    assert set(scales) == {w.path for w in model.trainable_weights}
    by_layer = {}
    for path, scale in scales.items():
        by_layer.setdefault(path.split("/")[0], set()).add(scale)
    assert by_layer["head"] == {1.0} and by_layer["encoder_norm"] == {1.0}
    for i in range(depth):
        assert by_layer[f"encoderblock_{i}"] == {0.5 ** (depth - i)}
    assert by_layer["patch_encoder"] == {0.5 ** (depth + 1)}
    with pytest.raises(ValueError, match=r"`decay` must be in \(0, 1\]"):
        keras_vit.layer_decay_scales(model, 1.5)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="TransformerBlocks"):
        keras_vit.layer_decay_scales(plain, 0.5)


def test_layer_decay_updates_each_variable_as_adamw_at_its_scaled_rate():
    model = make_model(layer_decay=0.5, clip=None)
    scales = model.optimizer.learning_rate_scales
    x, y = next(iter(batches(16)))
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x, y, model(tf.cast(x, "float32"), training=True))
    grads = tape.gradient(loss, model.trainable_weights)
    before = [w.numpy() for w in model.trainable_weights]
    for _ in range(3):
        model.optimizer.apply(grads, model.trainable_weights)
    # Warm-up: each step has its own rate; the reference's schedule is the same one, scaled.
    for variable, grad, start in zip(model.trainable_weights, grads, before):
        reference_variable = keras.Variable(start)
        reference = keras.optimizers.AdamW(
            training.learning_rate_schedule(1e-3 * scales[variable.path], 100, 2), weight_decay=0.1
        )
        for _ in range(3):
            reference.apply([grad], [reference_variable])
        np.testing.assert_allclose(variable.numpy(), reference_variable.numpy(), atol=1e-7, err_msg=variable.path)


def test_scales_that_name_no_variable_are_reported(caplog):
    model = keras_vit.build_vit("testing", image_size=16, num_classes=4)
    optimizer = training.AdamW(1e-3, learning_rate_scales={"head/kernel": 1.0, "other_model/kernel": 0.5})
    with caplog.at_level("WARNING", logger="keras_vit"):
        optimizer.build(model.trainable_variables)
    assert "1 learning-rate scales name no variable" in caplog.text and "other_model/kernel" in caplog.text


def test_layer_decay_survives_save_and_load(tmp_path):
    model = make_model(layer_decay=0.7, ema_momentum=0.9, built=False)  # Built by fit's first trace.
    model.fit(batches(16), epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.learning_rate_scales == model.optimizer.learning_rate_scales
    assert loaded.optimizer.use_ema and loaded.optimizer.ema_momentum == 0.9


def test_layer_decay_checks_the_private_apis_it_relies_on(monkeypatch):
    from keras_vit import compat
    from keras_vit.compat import optimizers

    monkeypatch.setitem(optimizers._SCALE_METHODS, "_no_such_method", ("self",))
    assert training.AdamW(1e-3).learning_rate_scales == {}  # Without scales: Keras' own optimizer.
    with pytest.raises(compat.PrivateApiError, match=r"LearningRateScales .*_no_such_method does not exist"):
        training.AdamW(1e-3, learning_rate_scales={"head/kernel": 0.5})


# === Together: a resumed run, two replicas ===


ALL = dict(ema_momentum=0.9, layer_decay=0.75, accumulation=2, mixup=0.8, cutmix=1.0)


def train(folder, stop=None, **options):
    model = make_model(**options)
    ema = callbacks.EMAWeights()
    initial_epoch = backups.restore_backup(model, folder)
    used = [callbacks.Backup(folder), ema, ema.restorer()] + ([StopAfter(stop)] if stop is not None else [])
    model.fit(batches(16), epochs=3, initial_epoch=initial_epoch, verbose=0, shuffle=False,
              validation_data=batches(32), callbacks=used)  # fmt: skip
    return model


@pytest.mark.slow
def test_a_resumed_run_with_everything_on_ends_as_the_uninterrupted_one(tmp_path):
    # The uninterrupted run's optimizer is built by fit, in its first trace, as without a strategy; the others'
    # before fit (the resumed run's by restore_backup): both paths end alike.
    uninterrupted = train(str(tmp_path / "a"), built=False, **ALL)
    with pytest.raises(KeyboardInterrupt):
        train(str(tmp_path / "b"), stop=0, **ALL)
    resumed = train(str(tmp_path / "b"), **ALL)
    assert int(resumed.optimizer.iterations.numpy()) == 12
    assert_same_weights(weights(resumed), weights(uninterrupted), atol=1e-6)


@pytest.fixture(scope="module")
def replica_runs(two_replicas):
    """Runs on one device and on two replicas (the two_cpus child), float32 and mixed_bfloat16: EMA, layer
    decay, clipping, with and without accumulation and MixUp/CutMix. {precision: {run: weights, run_steps}}."""
    one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
    mirrored = two_replicas
    unmixed = dict(ALL, mixup=0.0, cutmix=0.0)
    runs = {}
    for precision in ("float32", "mixed_bfloat16"):
        keras.mixed_precision.set_global_policy(precision)
        results = runs[precision] = {}
        for name, strategy, options in (
            ("one_device", one_device, dict(unmixed, accumulation=1)),
            ("mirrored", mirrored, unmixed),
            # Each replica mixes its own share of the batch: with MixUp/CutMix, compared with two replicas.
            ("mirrored_mixing", mirrored, dict(ALL, accumulation=1)),
            ("mirrored_mixing_accumulating", mirrored, ALL),
        ):
            with strategy.scope():
                model = make_model(**options)
            ema = callbacks.EMAWeights()
            model.fit(batches(16), epochs=2, verbose=0, shuffle=False, validation_data=batches(32),
                      callbacks=[ema, ema.restorer()])  # fmt: skip
            results[name] = weights(model)
            results[name + "_steps"] = int(model.optimizer.iterations.numpy())
    keras.mixed_precision.set_global_policy("float32")
    return runs


@pytest.mark.slow
@pytest.mark.environment("two_cpus")
@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_two_replicas_accumulating_make_the_large_batch_update(replica_runs, precision):
    """EMA, layer decay, clipping and accumulation together: two replicas accumulating two micro-batches each
    update as one device does with the whole batch, and with MixUp/CutMix as two replicas do without
    accumulating."""
    results = replica_runs[precision]
    assert {results[k] for k in results if k.endswith("_steps")} == {8}
    run = {k: v for k, v in results.items() if not k.endswith("_steps")}
    # bfloat16 activations: micro-batches of 4 round otherwise than batches of 8 or 16.
    atol = 2e-6 if precision == "float32" else 5e-3
    assert_same_weights(run["mirrored"], run["one_device"], atol)
    assert_same_weights(run["mirrored_mixing_accumulating"], run["mirrored_mixing"], atol)


@pytest.mark.slow
@pytest.mark.environment("jax")
def test_jax_accumulating_makes_the_large_batch_update_on_one_device_and_data_parallel():
    import jax

    assert keras.backend.backend() == "jax" and len(jax.devices()) == 2
    run, steps = {}, {}
    try:
        for distribution in (None, keras.distribution.DataParallel()):
            keras.distribution.set_distribution(distribution)
            for accumulation in (1, 2):
                model = make_model(**dict(ALL, accumulation=accumulation), jit_compile=True)
                ema = callbacks.EMAWeights()
                model.fit(IMAGES, LABELS, batch_size=16, epochs=2, shuffle=False, verbose=0,
                          callbacks=[ema, ema.restorer()])  # fmt: skip
                key = f"{'data_parallel' if distribution else 'one_device'}_{accumulation}"
                run[key] = [np.asarray(w) for w in model.weights]
                steps[key] = int(np.asarray(model.optimizer.iterations))
    finally:
        keras.distribution.set_distribution(None)
    assert set(steps.values()) == {8}
    assert_same_weights(run["one_device_2"], run["one_device_1"], atol=2e-6)
    # Data parallel: each device mixes and splits its own half of the batch.
    assert_same_weights(run["data_parallel_2"], run["data_parallel_1"], atol=2e-6)


# === The training job ===


def job_config():
    from tests.builders import tiny_digits_config

    config = tiny_digits_config(epochs=2)
    config.visualize, config.model.num_layers = False, 2
    config.ema_momentum, config.layer_decay, config.grad_accum_steps = 0.9, 0.75, 2
    config.augment.mixup_alpha = 0.8
    config.tensorboard_figures = 0  # The per-epoch TensorBoard figures (seconds an epoch): not checked here.
    # 7 does not divide the 20 steps of an epoch: the job runs 5 per execution, and each epoch its 20 steps.
    config.steps_per_execution = 7
    return config


@pytest.mark.slow
def test_the_job_validates_keeps_and_reports_the_average_and_resumes_with_everything_on(tmp_path):
    """Killed after its first epoch and started again, the job finishes from its backup and reports, keeps and
    saves what it validated: the moving average (the exact state of all three is
    test_a_resumed_run_with_everything_on_ends_as_the_uninterrupted_one's; the job's own exact resume,
    tests/test_lifecycle.py's)."""
    import csv

    from experiments import train

    config = job_config()
    with pytest.raises(KeyboardInterrupt):
        train.train_and_evaluate(config, str(tmp_path / "run"), callbacks=[StopAfter(0)])
    metrics = train.train_and_evaluate(config, str(tmp_path / "run"))
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    # One update per batch of 64 (two micro-batches of 32 each), as many as an uninterrupted run's.
    # history.json has every epoch, the killed process's first one included.
    assert metrics["steps"] == 2 * (1293 // 64) and len(history["val_accuracy"]) == 2
    # What was validated each epoch is what the job ends with and keeps as best.keras: the moving average.
    # (metrics.json's losses are without label smoothing, fit's with it: the accuracies compare.)
    assert metrics["validation_accuracy"] == pytest.approx(history["val_accuracy"][-1], abs=1e-6)
    with open(tmp_path / "run" / "log.csv") as f:
        epochs = list(csv.DictReader(f))  # both processes' epochs
    assert [row["epoch"] for row in epochs] == ["0", "1"]
    accuracies = [float(row["val_accuracy"]) for row in epochs]
    best_epoch = int(np.argmax(accuracies))  # The first of equals: saved on improvement only.
    assert metrics["best_validation_accuracy"] == pytest.approx(float(epochs[best_epoch]["val_accuracy"]), abs=1e-6)
    saved = keras.saving.load_model(tmp_path / "run" / "model.keras")
    assert saved.optimizer.use_ema and set(saved.optimizer.learning_rate_scales.values()) == {
        1.0, 0.75, 0.75**2, 0.75**3
    }


def test_the_config_fields_are_checked():
    from experiments import config_checks

    for field, value, expected in (
        ("ema_momentum", 1.0, r"a number in \[0.0, 1.0\)"),
        ("layer_decay", 0.0, r"a number in \(0.0, 1.0\]"),
        ("grad_accum_steps", 0, "an integer >= 1"),
        ("grad_accum_steps", 3, "a divisor of config.batch_size=64"),
    ):
        config = job_config()
        config[field] = value
        with pytest.raises(config_checks.ConfigError, match=rf"config.{field} must be {expected}"):
            config_checks.check_config(config)
