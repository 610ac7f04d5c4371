"""MixUp/CutMix in the training step (keras_vit.mixing): exact label/image consistency, seeds, `fit`
on TensorFlow (XLA on and off, MirroredStrategy) and JAX (plain and keras.distribution.DataParallel),
save/reload."""

import contextlib
import doctest
import re

import keras
import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import keras_vit
from keras_vit import mixing

# float32 rounding of a blend of 0 and 255 divided by 255, and of area fractions.
TOL = 1e-5


def one_hot_pixels(classes, num_classes, height=6, width=5):
    """uint8 images whose every pixel is 255 * one_hot(class) over `num_classes` channels, and the labels.

    A mixed image's pixel divided by 255 is then the mixed label it should carry, pixel by pixel.
    """
    labels = np.eye(num_classes, dtype="float32")[classes]
    images = np.broadcast_to(255 * labels[:, None, None, :], (len(classes), height, width, num_classes))
    return images.astype("uint8"), labels


def test_mixup_labels_match_images():
    classes = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    images, labels = one_hot_pixels(classes, 4)
    mixer = mixing.BatchMixer(mixup_alpha=0.8, seed=3)
    lams = []
    for step in range(5):
        mixed, mixed_labels = (np.asarray(t) for t in mixer(images, labels, step))
        assert mixed.dtype == np.float32 and mixed_labels.dtype == np.float32
        # Every pixel carries the mixed label; the partner of example i is example 7 - i.
        np.testing.assert_allclose(mixed / 255, np.broadcast_to(mixed_labels[:, None, None], mixed.shape), atol=TOL)
        lam = mixed_labels[0, classes[0]]
        expected = lam * labels + (1 - lam) * labels[::-1]
        np.testing.assert_allclose(mixed_labels, expected, atol=TOL)
        assert 0 < lam < 1
        lams.append(lam)
    assert len(set(np.round(lams, 6))) == 5, f"the steps drew repeated lambdas: {lams}"


def test_cutmix_pasted_area_is_the_label_weight():
    classes = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    images, labels = one_hot_pixels(classes, 4, height=12, width=10)
    mixer = mixing.BatchMixer(cutmix_alpha=1.0, seed=5)
    areas = []
    for step in range(12):
        mixed, mixed_labels = (np.asarray(t) for t in mixer(images, labels, step))
        # Each pixel is wholly the example's or wholly its partner's (7 - i), and the partner's pixels
        # form one box, the same for the whole batch.
        pasted = mixed[..., classes[::-1]].diagonal(axis1=0, axis2=3).transpose(2, 0, 1) == 255
        own = mixed[..., classes].diagonal(axis1=0, axis2=3).transpose(2, 0, 1) == 255
        assert np.all(pasted ^ own)
        assert np.all(pasted == pasted[0])
        rows, cols = np.nonzero(pasted[0])
        if len(rows):
            assert pasted[0].sum() == (np.ptp(rows) + 1) * (np.ptp(cols) + 1), "the pasted pixels are not a box"
        area = pasted[0].mean()
        np.testing.assert_allclose(mixed_labels, (1 - area) * labels + area * labels[::-1], atol=TOL)
        areas.append(area)
    assert len(set(areas)) > 6 and 0 < np.mean(areas) < 1, areas


@pytest.mark.parametrize(
    "y_fraction, x_fraction, rows, cols",
    [(0.5, 0.5, (3, 9), (3, 8)), (0.0, 0.0, (0, 3), (0, 3)), (0.99, 0.99, (8, 12), (7, 10))],
)
def test_cutmix_box(y_fraction, x_fraction, rows, cols):
    """lam = 0.75 on 12 x 10: a 6 x 5 box (sides scaled by sqrt(1 - lam)) centred on the drawn pixel,
    cut off at the edges; the label weight is the area left."""
    keep, kept = mixing.BatchMixer._box(np.float32(0.75), y_fraction, x_fraction, 12, 10)
    expected = np.ones((12, 10, 1), "float32")
    expected[rows[0] : rows[1], cols[0] : cols[1]] = 0
    np.testing.assert_array_equal(np.asarray(keep), expected)
    np.testing.assert_allclose(float(kept), expected.mean(), atol=1e-7)


@pytest.mark.parametrize("switch_prob, expected", [(0.0, 0), (1.0, 24), (0.5, None)])
def test_switch_prob_picks_cutmix(switch_prob, expected):
    images, labels = one_hot_pixels(np.array([0, 1, 2, 3]), 4)
    mixer = mixing.BatchMixer(mixup_alpha=1.0, cutmix_alpha=1.0, switch_prob=switch_prob, seed=0)
    cutmix = 0
    for step in range(24):
        mixed, mixed_labels = (np.asarray(t) for t in mixer(images, labels, step))
        np.testing.assert_allclose(mixed.mean((1, 2)) / 255, mixed_labels, atol=TOL)  # Either way.
        # MixUp blends every pixel alike; CutMix leaves pixels of 0 or 255 only.
        cutmix += bool(np.all((mixed == 0) | (mixed == 255)))
    if expected is None:
        assert 5 <= cutmix <= 19, cutmix  # Binomial(24, 0.5): 2.9 standard deviations either side.
    else:
        assert cutmix == expected


def test_groups_pair_within_each_group():
    images, labels = one_hot_pixels(np.array([0, 1, 2, 3, 4, 5]), 6)
    mixed, mixed_labels = mixing.BatchMixer(mixup_alpha=1.0, seed=1)(images, labels, 0, groups=2)
    lam = np.asarray(mixed_labels)[0, 0]
    partners = labels[[2, 1, 0, 5, 4, 3]]
    np.testing.assert_allclose(mixed_labels, lam * labels + (1 - lam) * partners, atol=TOL)


def test_same_seed_same_draws_and_steps_differ():
    images, labels = one_hot_pixels(np.array([0, 1, 2, 3]), 4)

    def draws(seed, step):
        mixer = mixing.BatchMixer(mixup_alpha=0.5, cutmix_alpha=1.0, seed=seed)  # A new instance: another run.
        return np.asarray(mixer(images, labels, step)[1])

    np.testing.assert_array_equal(draws(7, 4), draws(7, 4))
    np.testing.assert_array_equal(draws(7, np.int64(4)), draws(7, 4))
    assert not np.array_equal(draws(7, 4), draws(7, 5))
    assert not np.array_equal(draws(7, 4), draws(8, 4))


@pytest.mark.parametrize("alpha", [0.2, 1.0, 2.0])
def test_sample_beta_is_beta(alpha):
    samples = np.asarray(mixing.sample_beta(alpha, (4000,), seed=keras.random.SeedGenerator(11)))
    assert np.all((samples >= 0) & (samples <= 1))
    # Mean 1/2, variance 1 / (4 (2 alpha + 1)); 5 standard errors.
    variance = 1 / (4 * (2 * alpha + 1))
    assert abs(samples.mean() - 0.5) < 5 * np.sqrt(variance / 4000)
    assert abs(samples.var() - variance) < 5 * np.sqrt(2 * variance**2 / 4000) + 0.004
    assert scipy.stats.kstest(samples, scipy.stats.beta(alpha, alpha).cdf).pvalue > 1e-3


def test_invalid_arguments():
    model = consistency_model()
    for kwargs, match in [
        ({"mixup_alpha": -0.1}, "mixup_alpha"),
        ({"cutmix_alpha": -1}, "cutmix_alpha"),
        ({"cutmix_alpha": float("nan")}, "cutmix_alpha"),
        ({"mixup_alpha": 1.0, "switch_prob": 1.5}, "switch_prob"),
        ({"mixup_alpha": 1.0, "switch_prob": -0.1}, "switch_prob"),
    ]:
        with pytest.raises(ValueError, match=match):
            mixing.enable_batch_mixing(model, **kwargs)
    assert model.batch_mixer is None
    plain = keras.Sequential([keras.Input((6, 5, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"Batch mixing needs a model whose class derives from keras_vit.Training"):
        mixing.enable_batch_mixing(plain, mixup_alpha=0.8)
    mixer = mixing.BatchMixer(mixup_alpha=1.0, seed=0)
    images, labels = one_hot_pixels(np.array([0, 1]), 2)
    with pytest.raises(ValueError, match="one-hot labels"):
        mixer(images, labels[:, 0], 0)
    with pytest.raises(ValueError, match="float labels.*int32"):
        mixer(images, labels.astype("int32"), 0)
    with pytest.raises(ValueError, match=r"images \(batch, height, width, channels\).*\(2, 6, 5\)"):
        mixer(images[..., 0], labels, 0)
    with pytest.raises(ValueError, match="images"):
        mixer({"images": images}, labels, 0)


def test_docstring_example():
    result = doctest.testmod(mixing, verbose=False)
    assert result.attempted > 0 and result.failed == 0


# === fit ===

# Classes chosen so that reversing the whole batch of 8 pairs no two examples of a class, while
# reversing each half (two replicas or devices) pairs four of the eight with their own class.
FIT_CLASSES = np.array([0, 1, 2, 0, 3, 1, 2, 3])


def label_max(y_true, y_pred):
    """The largest label weight of each example: 1 unmixed, below 1 mixed with another class."""
    return keras.ops.max(y_true, axis=-1)


def consistency_model(num_classes=4):
    """Maps an image of `one_hot_pixels` to the label it carries: the mean pixel / 255.

    Trained with the mean squared error on consistently mixed batches its loss is 0 (rounding
    aside); the zero-initialised Dense gives the optimizer a weight, which gets no gradient then.
    """
    images = keras.Input((6, 5, num_classes))
    pixels = keras.layers.Rescaling(1 / 255)(keras.layers.GlobalAveragePooling2D()(images))
    correction = keras.layers.Dense(num_classes, kernel_initializer="zeros")(pixels)
    return RecordingModel(images, keras.layers.Add()([pixels, correction]))


class RecordingModel(keras_vit.TrainingSteps, keras.Model):
    """A model of the user's own with keras_vit's training step; it records the dtype of the images that
    enter the compiled step (when the step is traced)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.input_dtypes = []

    def train_step(self, *args):
        self.input_dtypes.append(keras.backend.standardize_dtype(keras.tree.flatten(args[-1])[0].dtype))
        return super().train_step(*args)


def expected_label_max(seed, steps, groups=1, jit_compile=True, **alphas):
    """The epochs' mean `label_max` when epoch k is the one step k on the batch of FIT_CLASSES.

    On TensorFlow the mixer runs compiled as in `fit`: TensorFlow's random ops draw other numbers
    from the same seed with XLA than without. On JAX it runs jitted too, one compilation for all the
    steps (eager, each of its ops compiles on its own; JAX draws the same numbers either way).
    """
    images, labels = one_hot_pixels(FIT_CLASSES, 4)
    mixer = mixing.BatchMixer(seed=seed, **alphas)

    def mixed_labels(step):
        return mixer(images, labels, step, groups=groups)[1]

    steps = range(steps)
    if keras.backend.backend() == "tensorflow":
        mixed_labels = tf.function(mixed_labels, jit_compile=jit_compile)
        steps = [tf.constant(step, "int64") for step in steps]  # One trace for all.
    elif keras.backend.backend() == "jax":
        import jax

        mixed_labels = jax.jit(mixed_labels)
    return [float(np.asarray(mixed_labels(step)).max(-1).mean()) for step in steps]


def tf_data(images, labels):
    """`fit`'s data: the batch of 8 as a tf.data pipeline of uint8 images and float32 one-hot labels."""
    ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(8)
    assert ds.element_spec[0].dtype == tf.uint8 and ds.element_spec[1].dtype == tf.float32
    return {"x": ds, "shuffle": False}


def numpy_data(images, labels):
    """`fit`'s data: NumPy batches of 8 in order, what a JAX input pipeline hands over."""
    assert images.dtype == np.uint8 and labels.dtype == np.float32
    return {"x": images, "y": labels, "batch_size": 8, "shuffle": False}


def fit_check(data=tf_data, strategy_scope=None, groups=1, jit_compile=True, steps=4):
    """Fits the consistency model with mixing for `steps` epochs of one batch; what `check_fit` asserts.

    The child processes (other backends, devices) run it too, with their own `data`.
    """
    images, labels = one_hot_pixels(FIT_CLASSES, 4)
    with strategy_scope or contextlib.nullcontext():
        model = consistency_model()
        mixing.enable_batch_mixing(model, mixup_alpha=0.8, cutmix_alpha=1.0, seed=4)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=[label_max], jit_compile=jit_compile
        )
    history = model.fit(**data(images, labels), epochs=steps, verbose=0).history
    evaluate_data = {key: value for key, value in data(images, labels).items() if key != "shuffle"}
    evaluation = model.evaluate(**evaluate_data, verbose=0, return_dict=True)
    return {
        "input_dtypes": sorted(set(model.input_dtypes)),
        "loss": history["loss"],
        "label_max": history["label_max"],
        "expected": expected_label_max(4, steps, groups, jit_compile, mixup_alpha=0.8, cutmix_alpha=1.0),
        "evaluate_label_max": float(evaluation["label_max"]),
        "weights": [float(np.abs(w).max()) for w in model.get_weights()],
    }


def check_fit(result):
    assert result["input_dtypes"] == ["uint8"], result
    # Images and labels mixed alike: the loss is float32 rounding only (a label weight off by e
    # makes it about e**2 / 2).
    assert max(result["loss"]) < 1e-9, result
    # The mixing of step k is the mixer's for (seed, k): the same sequence as the mixer run alone.
    np.testing.assert_allclose(result["label_max"], result["expected"], atol=1e-6)
    assert min(result["label_max"]) < 0.95 and len(set(np.round(result["label_max"], 6))) > 1, result
    assert result["evaluate_label_max"] == 1.0  # Evaluation does not mix.
    assert max(result["weights"]) < 1e-6, result  # The correction got no gradient: consistent mixing.


@pytest.mark.parametrize("jit_compile", [pytest.param(True, marks=pytest.mark.slow), False])
def test_fit_tensorflow(jit_compile):
    check_fit(fit_check(jit_compile=jit_compile))


def test_resumed_fit_continues_the_mixing_sequence(tmp_path):
    """The draws follow the optimizer's step, which BackupAndRestore restores: a resumed run mixes
    its remaining steps as the uninterrupted run does (`fit_check`'s `expected`)."""
    images, labels = one_hot_pixels(FIT_CLASSES, 4)
    expected = expected_label_max(4, 4, jit_compile=False, mixup_alpha=0.8, cutmix_alpha=1.0)
    histories = []
    for epochs in (2, 4):  # The second run finds the first's backup and resumes after its 2 epochs.
        model = consistency_model()
        mixing.enable_batch_mixing(model, mixup_alpha=0.8, cutmix_alpha=1.0, seed=4)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=[label_max], jit_compile=False)
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)
        histories.append(model.fit(**tf_data(images, labels), epochs=epochs, callbacks=[backup], verbose=0).history)
        assert int(model.optimizer.iterations.numpy()) == epochs
    assert len(histories[1]["label_max"]) == 2  # It did resume.
    np.testing.assert_allclose(histories[0]["label_max"] + histories[1]["label_max"], expected, atol=1e-6)


@pytest.mark.slow
@pytest.mark.environment("two_cpus")
def test_fit_mirrored_strategy_two_replicas(two_replicas):
    strategy = two_replicas
    # Without XLA: Keras' XLA step under MirroredStrategy on logical devices of one CPU fails
    # without mixing too (a replica's variable read from the other device).
    result = fit_check(strategy_scope=strategy.scope(), groups=2, jit_compile=False)
    # Each replica pairs within its half of the batch: the expected sequence is that of groups=2,
    # which differs from the whole batch's.
    check_fit(result)
    whole_batch = expected_label_max(4, 4, jit_compile=False, mixup_alpha=0.8, cutmix_alpha=1.0)
    assert not np.allclose(result["expected"], whole_batch)


@pytest.mark.slow
def test_vit_fit_save_reload_predicts_the_same(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (32, 16, 16, 3), dtype=np.uint8)
    labels = np.eye(4, dtype="float32")[rng.integers(0, 4, 32)]
    train = tf.data.Dataset.from_tensor_slices((images, labels)).batch(8)
    assert train.element_spec[0].dtype == tf.uint8
    model = keras_vit.build_vit("testing", image_size=16, num_classes=4, head_kernel_initializer="glorot_uniform")
    num_weights = len(model.weights)
    mixing.enable_batch_mixing(model, mixup_alpha=0.8, cutmix_alpha=1.0, seed=0)
    # Without XLA, to save its compile time here; test_fit_tensorflow runs the mixing under XLA.
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3),
        loss=keras.losses.CategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    # Built here, as under a strategy's scope: in fit's first trace it would have the step traced twice.
    model.optimizer.build(model.trainable_variables)
    before = model.predict(images, verbose=0)
    history = model.fit(
        train,
        epochs=2,
        shuffle=False,
        validation_data=train,
        callbacks=[
            keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="val_loss", save_best_only=True),
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
        ],
        verbose=0,
    )
    assert np.all(np.isfinite(history.history["loss"] + history.history["val_loss"])), history.history
    assert len(model.weights) == num_weights  # No weight of the mixing's in the model.
    assert int(model.optimizer.iterations.numpy()) == 8
    trained = model.predict(images, verbose=0)
    assert np.abs(trained - before).max() > 1e-3  # It trained.
    # Inference does not mix: predict on uint8 equals a direct call on the same pixels as floats, up to float32
    # rounding (predict's graph runs oneDNN's fused layer norm and matmuls, the eager call the ops one by one:
    # 7e-7 and 1.4e-6 apart on logits near 1 with two different initial weights); mixing would move them by far more.
    np.testing.assert_allclose(trained, model(images.astype("float32"), training=False), rtol=0, atol=1e-5)
    model.save(tmp_path / "model.keras")
    for path in ("best.keras", "model.keras"):
        loaded = keras.saving.load_model(tmp_path / path)
        assert type(loaded) is type(model) and loaded.batch_mixer is None
        assert [w.shape for w in loaded.weights] == [w.shape for w in model.weights]
    # model.keras (loaded last): the same weights through the same graph on the CPU, equal up to the last bit;
    # 1e-6 allowed.
    np.testing.assert_allclose(loaded.predict(images, verbose=0), trained, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.environment("jax")
def test_fit_jax_plain_and_data_parallel():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    assert keras.backend.backend() == "jax" and len(jax.devices()) == 2
    result = {"plain": fit_check(numpy_data)}
    try:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        result["data_parallel"] = fit_check(numpy_data, groups=2)
    finally:
        keras.distribution.set_distribution(None)
    # The collectives XLA adds to the mixing of a batch sharded over the 2 devices.
    sharding = NamedSharding(jax.sharding.Mesh(jax.devices(), ("batch",)), PartitionSpec("batch"))
    batch = [jax.device_put(array, sharding) for array in one_hot_pixels(FIT_CLASSES, 4)]
    mixer = mixing.BatchMixer(mixup_alpha=0.8, cutmix_alpha=1.0, seed=0)
    collectives = {}
    for groups in (1, 2):
        step = jax.jit(lambda x, y, g=groups: mixer(x, y, 0, groups=g), out_shardings=(sharding, sharding))
        hlo = step.lower(*batch).compile().as_text()
        collectives[groups] = sorted(set(re.findall(r"collective-permute|all-to-all|all-gather", hlo)))
    check_fit(result["plain"])
    # Under DataParallel each device's half is reversed on its own.
    check_fit(result["data_parallel"])
    assert not np.allclose(result["data_parallel"]["expected"], result["plain"]["expected"])
    # Reversing within each device's shard needs no transfer between the devices; reversing the
    # whole batch would.
    assert collectives == {1: ["collective-permute"], 2: []}
