import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from keras_vit.testing import random_images, randomize_weights
from tests import numpy_vit
from tests.builders import PARAMS_GAP, SMALL, graph_flops, small_vit

# A grid of 2 x 3 patches, for the tests where height and width must not be mixed up.
RECTANGLE = (8, 12)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(classifier="gap"),
        dict(representation_size=12),
        dict(num_classes=None),
        dict(classifier="gap", patch_projection="matmul", patch_size=(2, 4)),
    ],
)
def test_forward_matches_numpy_reference(kwargs):
    model = randomize_weights(small_vit(image_size=RECTANGLE, **kwargs))
    images = random_images((3, *RECTANGLE, 3))
    params, num_layers = numpy_vit.params_from_model(model)
    assert num_layers == SMALL["num_layers"]
    expected = numpy_vit.vit_forward(
        params, num_layers, images, classifier=kwargs.get("classifier", "token")
    )
    got = model.predict(images, verbose=0)
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    # Not a vacuous comparison: the outputs differ across images and are not tiny.
    assert np.abs(expected).max() > 0.1 and np.ptp(expected, axis=0).max() > 0.1


def test_tanh_gelu_matches_numpy_reference():
    """activation="gelu_tanh": the reference with the tanh GELU within 1e-5, and clearly not the exact one."""
    model = randomize_weights(small_vit(activation="gelu_tanh"))
    images = random_images((3, 16, 16, 3))
    params, num_layers = numpy_vit.params_from_model(model)
    exact = numpy_vit.vit_forward(params, num_layers, images)
    expected = numpy_vit.vit_forward(params, num_layers, images, activation=numpy_vit.gelu_tanh)
    got = model.predict(images, verbose=0)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert np.abs(got - exact).max() > 1e-4
    assert [model.get_layer(f"encoderblock_{i}").activation for i in range(num_layers)] == ["gelu_tanh"] * num_layers


def test_uint8_and_float_pixels_give_the_same_output():
    model = randomize_weights(small_vit())
    images = random_images((2, 16, 16, 3))
    np.testing.assert_array_equal(
        model.predict(images.astype(np.uint8), verbose=0), model.predict(images, verbose=0)
    )


def test_without_rescaling_the_model_takes_normalised_inputs():
    model = randomize_weights(small_vit(include_rescaling=False))
    images = random_images((2, 16, 16, 3))
    params, num_layers = numpy_vit.params_from_model(model)
    expected = numpy_vit.vit_forward(params, num_layers, images / 127.5 - 1.0, rescale=False)
    np.testing.assert_allclose(model(images / 127.5 - 1.0), expected, atol=1e-5, rtol=1e-5)


def test_pixel_mean_and_std_normalise_as_the_weights_expect(tmp_path):
    """DeiT's ImageNet statistics: the model on raw pixels equals the NumPy forward pass on
    (x / 255 - mean) / std, and the statistics survive saving."""
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    model = randomize_weights(small_vit(pixel_mean=mean, pixel_std=std))
    images = random_images((2, 16, 16, 3))
    normalised = (images / 255.0 - np.array(mean)) / np.array(std)
    params, num_layers = numpy_vit.params_from_model(model)
    expected = numpy_vit.vit_forward(params, num_layers, normalised, rescale=False)
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-5, rtol=1e-5)
    model.save(tmp_path / "deit.keras")
    reloaded = keras.saving.load_model(tmp_path / "deit.keras")
    np.testing.assert_array_equal(reloaded.predict(images, verbose=0), model.predict(images, verbose=0))
    # 0.5 and 0.5 are the [-1, 1] of the original weights.
    half = randomize_weights(small_vit(pixel_mean=0.5, pixel_std=0.5))
    np.testing.assert_allclose(
        half.predict(images, verbose=0), randomize_weights(small_vit()).predict(images, verbose=0), atol=1e-5
    )
    for kwargs, message in (
        (dict(pixel_mean=mean), "go together"),
        (dict(pixel_mean=mean, pixel_std=(0.2, 0.0, 0.2)), "positive"),
        (dict(pixel_mean=(0.5, 0.5), pixel_std=std), "one per channel"),
        (dict(pixel_mean=mean, pixel_std=std, include_rescaling=False), "need include_rescaling=True"),
    ):
        with pytest.raises(ValueError, match=message):
            small_vit(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(classifier="gap", representation_size=8, dropout_rate=0.1, stochastic_depth_rate=0.1),
        dict(num_classes=None, attention_dropout_rate=0.1),
        dict(activation="gelu_tanh"),
        dict(position_embedding="sincos2d"),
        dict(classifier="map", position_embedding="sincos2d", activation="gelu_tanh"),
        dict(classifier="gap", pre_norm=True, pooled_norm=True),
    ],
)
def test_keras_save_and_reload_is_exact(tmp_path, kwargs):
    model = randomize_weights(small_vit(**kwargs))
    images = random_images((4, 16, 16, 3))
    expected = model.predict(images, verbose=0)
    path = tmp_path / "vit.keras"
    model.save(path)
    # No custom_objects and the default safe_mode=True: the layers are registered.
    restored = keras.saving.load_model(path)
    assert [layer.name for layer in restored.layers] == [layer.name for layer in model.layers]
    np.testing.assert_array_equal(restored.predict(images, verbose=0), expected)
    # Equal configs once JSON has turned tuples into lists.
    assert json.loads(json.dumps(restored.get_config())) == json.loads(json.dumps(model.get_config()))


@pytest.mark.parametrize("classifier", ["token", "gap", "map"])
def test_every_trainable_weight_receives_a_gradient(classifier):
    model = small_vit(classifier=classifier, representation_size=8)
    images = random_images((4, 16, 16, 3))
    labels = np.array([0, 1, 2, 3])
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    grads = tape.gradient(loss, model.trainable_weights)
    assert len(grads) == len(model.trainable_weights) > 0
    for weight, grad in zip(model.trainable_weights, grads):
        assert grad is not None, weight.path
        assert np.abs(np.asarray(grad)).max() > 0, weight.path


def test_default_head_and_class_token_start_at_zero():
    model = keras_vit.build_vit("testing", image_size=32, num_classes=3)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), 0.0)
    np.testing.assert_array_equal(model.get_layer("patch_encoder").class_token.numpy(), 0.0)


@pytest.mark.parametrize("precision, tolerance", [("mixed_bfloat16", 0.05), ("mixed_float16", 0.01)])
def test_mixed_precision_is_finite_and_close_to_float32(policy, precision, tolerance):
    reference = randomize_weights(small_vit(), scale=0.1)
    images = random_images((4, 16, 16, 3))
    expected = reference.predict(images, verbose=0)
    policy(precision)
    model = small_vit()
    model.set_weights(reference.get_weights())
    encoder = model.get_layer("patch_encoder")
    assert encoder.compute_dtype == precision.split("_")[1]
    assert encoder.class_token.dtype == "float32"  # Variables stay float32.
    got = model.predict(images, verbose=0)
    assert got.dtype == np.float32  # Logits are float32 under every policy.
    assert np.isfinite(got).all()
    scale = np.abs(expected).max()
    assert scale > 0.1
    assert np.abs(got - expected).max() <= tolerance * scale


@pytest.mark.slow
def test_mixed_precision_trains_with_xla(policy):
    policy("mixed_bfloat16")
    model = small_vit()
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    history = model.fit(random_images((8, 16, 16, 3)), np.arange(8) % 5, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.slow
def test_xla_compiled_train_step_runs_and_learns():
    model = small_vit(dropout_rate=0.1, stochastic_depth_rate=0.1)
    model.compile(
        optimizer=keras.optimizers.AdamW(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    assert model.jit_compile is True
    images, labels = random_images((16, 16, 16, 3)), np.arange(16) % 5
    before = [w.numpy().copy() for w in model.trainable_weights]
    history = model.fit(images, labels, batch_size=8, epochs=15, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0]  # It can fit 16 random images.
    changed = [not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights)]
    assert all(changed)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(image_size=30), r"image_size=30, patch_size=\(16, 16\)"),
        (dict(image_size=(32, 40)), r"image_size=\(32, 40\), patch_size=\(16, 16\)"),
        (dict(image_size=0), r"image_size=0"),
        (dict(image_size=(32, -32)), r"image_size=\(32, -32\)"),
        (dict(num_classes=-3), r"num_classes=-3"),
        (dict(representation_size=-1), r"representation_size=-1"),
        (dict(hidden_dim=0), r"hidden_dim=0"),
        (dict(num_layers=0), r"num_layers=0"),
        (dict(num_heads=-1), r"num_heads=-1"),
        (dict(mlp_dim=0), r"mlp_dim=0"),
        (dict(patch_size=0), r"patch_size=0"),
        (dict(hidden_dim=12, num_heads=5), r"hidden_dim=12, num_heads=5"),
        (dict(num_channels=0), r"num_channels=0"),
        (dict(classifier="cls"), r"classifier='cls'"),
        (dict(dropout_rate=1.0), r"dropout_rate=1.0"),
        (dict(activation="approximate"), r"activation='approximate'"),
        (dict(gelu="tanh"), r"the field `activation`.*Received: gelu='tanh'"),
        (dict(position_embedding="fixed"), r"position_embedding='fixed'"),
        (dict(position_embedding="sincos2d"), r"multiple of 4.*hidden_dim=10"),
        (dict(pre_norm=1), r"pre_norm=1"),
        (dict(pooled_norm="yes"), r"pooled_norm='yes'"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, pattern):
    args = dict(image_size=32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        keras_vit.build_vit("testing", **args)


def test_wrong_channel_count_raises_value_error():
    model = keras_vit.build_vit("testing", image_size=32, num_classes=3)
    with pytest.raises(ValueError, match=r"expects images of shape \(batch, 32, 32, 3\).*\(2, 32, 32, 1\)"):
        model(np.zeros((2, 32, 32, 1), "float32"))
    gray = keras_vit.build_vit("testing", image_size=32, num_classes=3, num_channels=1)
    assert gray(np.zeros((2, 32, 32, 1), "float32")).shape == (2, 3)


def test_names_are_stable():
    model = keras_vit.build_vit("testing", image_size=32, num_classes=3, representation_size=4)
    assert [layer.name for layer in model.layers] == [
        "images",
        "rescaling",
        "patch_encoder",
        "embedding_dropout",
        "encoderblock_0",
        "encoder_norm",
        "pooling",
        "pre_logits",
        "head",
    ]
    assert model.name == "vit_testing"
    assert keras_vit.build_vit("B/16", num_classes=None).name == "vit_b16"
    block = model.get_layer("encoderblock_0")
    assert sorted(w.path for w in block.weights) == sorted(
        f"encoderblock_0/{path}"
        for path in [
            "attention_norm/gamma",
            "attention_norm/beta",
            "attention/qkv_kernel",
            "attention/qkv_bias",
            "attention/output_kernel",
            "attention/output_bias",
            "mlp_norm/gamma",
            "mlp_norm/beta",
            "mlp_dense_1/kernel",
            "mlp_dense_1/bias",
            "mlp_dense_2/kernel",
            "mlp_dense_2/bias",
        ]
    )


def test_stochastic_depth_rate_grows_linearly_with_depth():
    model = keras_vit.build_vit("testing", image_size=32, num_layers=5, stochastic_depth_rate=0.2)
    rates = [model.get_layer(f"encoderblock_{i}").stochastic_depth_rate for i in range(5)]
    np.testing.assert_allclose(rates, [0.0, 0.05, 0.1, 0.15, 0.2])


def test_hybrid_keras_save_and_reload_is_exact(tmp_path):
    model = randomize_weights(
        keras_vit.build_vit("R+Ti/16", image_size=64, num_classes=3, num_layers=1), scale=0.05
    )
    images = random_images((2, 64, 64, 3))
    expected = model.predict(images, verbose=0)
    assert np.isfinite(expected).all() and np.ptp(expected) > 0
    model.save(tmp_path / "hybrid.keras")
    restored = keras.saving.load_model(tmp_path / "hybrid.keras")
    np.testing.assert_array_equal(restored.predict(images, verbose=0), expected)


def _to_flat_qkv_layout(weights_h5, destination):
    """Copies a weights file (.weights.h5) with every attention's `qkv_kernel` (D, 3, D) and
    `qkv_bias` (3, D) rewritten as earlier versions saved them: (D, 3D) and (3D,), same numbers."""
    import h5py

    with h5py.File(weights_h5, "r") as source, h5py.File(destination, "w") as target:
        for key, value in source.attrs.items():
            target.attrs[key] = value

        def copy(name, item):
            if isinstance(item, h5py.Group):
                group = target.require_group(name)
                for key, value in item.attrs.items():
                    group.attrs[key] = value
                return
            array = item[()]
            if name.endswith("attention/vars/0") and array.ndim == 3:
                array = array.reshape(array.shape[0], -1)
            elif name.endswith("attention/vars/1") and array.ndim == 2:
                array = array.reshape(-1)
            target.create_dataset(name, data=array)

        source.visititems(copy)


def test_files_saved_with_the_flat_qkv_layout_load_exactly(tmp_path):
    """.keras and .weights.h5 files holding (D, 3D) / (3D,) query-key-value weights load into the
    (D, 3, D) / (3, D) layout with the same outputs; Keras' own loading refuses those shapes."""
    import zipfile

    import h5py

    model = randomize_weights(small_vit(num_layers=2))
    images = random_images((4, 16, 16, 3))
    expected = model.predict(images, verbose=0)
    model.save(tmp_path / "new.keras")
    with zipfile.ZipFile(tmp_path / "new.keras") as archive:
        archive.extract("model.weights.h5", tmp_path / "new")
        entries = {name: archive.read(name) for name in archive.namelist() if name != "model.weights.h5"}
    _to_flat_qkv_layout(tmp_path / "new" / "model.weights.h5", tmp_path / "flat.weights.h5")
    with h5py.File(tmp_path / "flat.weights.h5", "r") as f:
        shapes = {f[f"layers/transformer_block{s}/attention/vars/{i}"].shape for s in ("", "_1") for i in (0, 1)}
    assert shapes == {(16, 48), (48,)}
    with zipfile.ZipFile(tmp_path / "flat.keras", "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        archive.write(tmp_path / "flat.weights.h5", "model.weights.h5")

    restored = keras.saving.load_model(tmp_path / "flat.keras")
    attention = restored.get_layer("encoderblock_1").attention
    assert tuple(attention.qkv_kernel.shape) == (16, 3, 16) and tuple(attention.qkv_bias.shape) == (3, 16)
    np.testing.assert_array_equal(restored.predict(images, verbose=0), expected)
    for new, old in zip(restored.weights, model.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(new), keras.ops.convert_to_numpy(old))

    fresh = small_vit(num_layers=2)
    fresh.load_weights(tmp_path / "flat.weights.h5")
    np.testing.assert_array_equal(fresh.predict(images, verbose=0), expected)

    # What the override is for: Keras' loading assigns the stored arrays as they are.
    with h5py.File(tmp_path / "flat.weights.h5", "r") as f:
        store = {key: value[()] for key, value in f["layers/transformer_block/attention/vars"].items()}
    with pytest.raises(ValueError, match=r"\(16, 48\)"):
        keras.layers.Layer.load_own_variables(fresh.get_layer("encoderblock_0").attention, store)


# === Fixed 2-D sin-cos position embeddings and the MAP head ===


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_sincos_model_is_the_learned_model_with_big_visions_embeddings(classifier):
    """A sincos2d model computes what a learned-embedding model (itself checked against the NumPy
    reference) computes with its position embeddings set to big_vision's formula, on a rectangular
    grid; the class token gets no position."""
    fixed = randomize_weights(small_vit(image_size=RECTANGLE, classifier=classifier, position_embedding="sincos2d"))
    learned = small_vit(image_size=RECTANGLE, classifier=classifier)
    posemb = numpy_vit.posemb_sincos_2d(2, 3, 16)
    if classifier == "token":
        posemb = np.concatenate([np.zeros((1, 1, 16)), posemb], axis=1)
    by_name = {v.path: v for v in fixed.weights}
    for weight in learned.weights:
        source = posemb if weight.path == "patch_encoder/position_embedding" else by_name[weight.path]
        weight.assign(keras.ops.convert_to_numpy(source).astype("float32"))
    images = random_images((3, *RECTANGLE, 3))
    np.testing.assert_allclose(fixed.predict(images, verbose=0), learned.predict(images, verbose=0), atol=1e-5)
    # No weight: the learned model has exactly the embeddings' parameters more.
    assert learned.count_params() - fixed.count_params() == posemb.size


def test_map_model_pools_the_encoder_tokens_with_the_map_head():
    model = randomize_weights(small_vit(classifier="map", activation="gelu_tanh"))
    assert model.get_layer("patch_encoder").use_class_token is False
    images = random_images((3, 16, 16, 3))
    tokens = keras.Model(model.inputs, model.get_layer("encoder_norm").output).predict(images, verbose=0)
    assert tokens.shape == (3, 16, 16)  # No class token.
    from keras_vit import checkpoints

    weights = {v.path: keras.ops.convert_to_numpy(v) for v in model.weights if v.path.startswith("pooling/")}
    params = checkpoints.to_checkpoint(weights, SMALL["num_heads"])
    params = {key[len("MAPHead_0/") :]: value.astype(np.float64) for key, value in params.items()}
    head = model.get_layer("head")
    expected = numpy_vit.map_head(tokens, params, numpy_vit.gelu_tanh) @ head.kernel.numpy() + head.bias.numpy()
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-5, rtol=1e-5)


def test_parameter_counts_of_the_better_plain_vit_models():
    """S/16 with fixed position embeddings: the GAP model (big_vision's "Better plain ViT baselines")
    has the GAP count less the learned embeddings; the MAP model adds big_vision's MAPHead."""
    posemb = 196 * 384
    gap = keras_vit.build_vit("S/16", classifier="gap", position_embedding="sincos2d")
    assert gap.count_params() == PARAMS_GAP["S/16"] - posemb == 21_974_632
    mapped = keras_vit.build_vit("S/16", classifier="map", position_embedding="sincos2d")
    assert mapped.count_params() == PARAMS_GAP["S/16"] - posemb + numpy_vit.map_head_params(384, 1536)
    keras.backend.clear_session()


@pytest.mark.parametrize("kwargs", [dict(classifier="map"), dict(classifier="map", position_embedding="sincos2d")])
def test_map_and_sincos_models_through_the_model_utilities(kwargs):
    """set_image_size (sin-cos embeddings computed for the new grid, not resampled), replace_head,
    freeze_backbone, count_flops, the layout map and the attention maps work for these options."""
    from keras_vit import distribute, visualize

    model = randomize_weights(small_vit(image_size=RECTANGLE, **kwargs))
    bigger = keras_vit.set_image_size(model, (12, 16))
    encoder = bigger.get_layer("patch_encoder")
    if kwargs.get("position_embedding") == "sincos2d":
        np.testing.assert_allclose(encoder.position_embedding, numpy_vit.posemb_sincos_2d(3, 4, 16), atol=1e-6)
    direct = small_vit(image_size=(12, 16), **kwargs)
    direct.set_weights(bigger.get_weights())
    images = random_images((2, 12, 16, 3))
    np.testing.assert_array_equal(bigger.predict(images, verbose=0), direct.predict(images, verbose=0))
    for key, value in {v.path: v.numpy() for v in model.weights}.items():
        if key != "patch_encoder/position_embedding":
            np.testing.assert_array_equal({v.path: v.numpy() for v in bigger.weights}[key], value, err_msg=key)

    new = keras_vit.freeze_backbone(keras_vit.replace_head(model, 3))
    assert [w.path for w in new.trainable_weights] == ["head/kernel", "head/bias"]
    args = dict({**SMALL, "image_size": RECTANGLE}, num_classes=5, **kwargs)
    args.pop("position_embedding", None)
    assert keras_vit.count_flops("testing", **args) == graph_flops(model, RECTANGLE)

    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], ["cpu:0"])
    assert distribute.get_layout_map(mesh, config=model)["pooling/key_value_kernel"] is None  # replicated
    attentions = visualize.attention_weights(model, random_images((2, *RECTANGLE, 3)))
    assert attentions.shape == (2, 2, 4, 6, 6)
    np.testing.assert_allclose(attentions.sum(-1), 1.0, atol=1e-5)
    assert visualize.position_embedding_similarity(model).shape == (2, 3, 2, 3)


def test_pre_norm_and_pooled_norm_move_the_layer_norms():
    """pre_norm: LN of the embedded tokens feeds the first block; pooled_norm: the model's output is
    head(LN(mean of the last block's tokens)) in place of head(mean of LN(tokens)) (timm's norm_pre
    and fc_norm), against NumPy layer norms."""
    model = randomize_weights(small_vit(classifier="gap", pre_norm=True, pooled_norm=True))
    names = [layer.name for layer in model.layers]
    assert names[names.index("embedding_dropout") :] == [
        "embedding_dropout", "pre_norm", "encoderblock_0", "encoderblock_1", "pooling", "pooled_norm", "head"
    ]
    images = random_images((3, 16, 16, 3))

    def output_of(name):
        return keras.Model(model.inputs, model.get_layer(name).output).predict(images, verbose=0).astype(np.float64)

    pre, pooled, head = (model.get_layer(name) for name in ("pre_norm", "pooled_norm", "head"))
    tokens = output_of("patch_encoder")
    normalised = numpy_vit.layer_norm(tokens, pre.gamma.numpy(), pre.beta.numpy())
    np.testing.assert_allclose(output_of("pre_norm"), normalised, atol=1e-5)
    assert np.abs(normalised - tokens).max() > 0.1
    features = numpy_vit.layer_norm(output_of("encoderblock_1").mean(axis=1), pooled.gamma.numpy(), pooled.beta.numpy())
    expected = features @ head.kernel.numpy() + head.bias.numpy()
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-5, rtol=1e-5)


def test_a_frozen_backbone_gives_the_same_features_in_fit_as_in_predict():
    """freeze_backbone: dropout and stochastic depth off in the frozen layers (training=True is inference
    there); unfrozen, the same model's training features differ (the check can fail)."""
    model = randomize_weights(keras_vit.build_vit(
        "testing", image_size=16, num_classes=3, patch_size=4, num_heads=2, num_layers=2, classifier="map",
        dropout_rate=0.3, attention_dropout_rate=0.3, stochastic_depth_rate=0.5), scale=0.1)
    backbone = keras_vit.replace_head(model, None)
    images = random_images((8, 16, 16, 3))
    inference = keras.ops.convert_to_numpy(backbone(images, training=False))
    assert np.abs(keras.ops.convert_to_numpy(backbone(images, training=True)) - inference).max() > 1e-3
    keras_vit.freeze_backbone(model)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(backbone(images, training=True)), inference)
    # In fit: the head's gradient step sees the inference features, and only the head changes.
    features = []

    class Features(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            features.append(keras.ops.convert_to_numpy(backbone(images, training=True)))

    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    model.fit(images, np.arange(8) % 3, epochs=2, batch_size=4, verbose=0, callbacks=[Features()])
    for seen in features:
        np.testing.assert_array_equal(seen, inference)
    keras_vit.freeze_backbone(model, trainable=True)
    assert np.abs(keras.ops.convert_to_numpy(backbone(images, training=True)) - inference).max() > 1e-3
