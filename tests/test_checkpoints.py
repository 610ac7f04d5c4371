import io

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import checkpoints
from keras_vit.testing import random_images, randomize_weights
from tests import numpy_vit
from tests.builders import assert_load_fails_unchanged, small_vit, weights_of, write_npz


@pytest.fixture
def source(tmp_path):
    """A random 16-px model and its checkpoint in the original (vit_jax) naming."""
    model = randomize_weights(small_vit(), seed=1)
    path = tmp_path / "source.npz"
    keras_vit.save_npz(model, str(path))
    return model, str(path)


def reference_params(npz):
    """The checkpoint's arrays renamed for the NumPy reference (tests/numpy_vit.py)."""
    params = {}
    for key, value in npz.items():
        name = key.replace("Transformer/", "").replace("MultiHeadDotProductAttention_1/", "")
        name = name.replace("MlpBlock_3/", "").replace("posembed_input/", "")
        params[name] = np.asarray(value, np.float64)
    return params


def test_checkpoint_uses_the_original_names_and_shapes(source):
    _, path = source
    npz = checkpoints.read_npz(path)
    assert npz["embedding/kernel"].shape == (4, 4, 3, 16)
    assert npz["cls"].shape == (1, 1, 16)
    assert npz["Transformer/posembed_input/pos_embedding"].shape == (1, 17, 16)
    attention = "Transformer/encoderblock_1/MultiHeadDotProductAttention_1/"
    assert npz[attention + "query/kernel"].shape == (16, 4, 4)
    assert npz[attention + "value/bias"].shape == (4, 4)
    assert npz[attention + "out/kernel"].shape == (4, 4, 16)
    assert npz["Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"].shape == (16, 32)
    assert npz["head/kernel"].shape == (16, 5)
    assert len(npz) == 6 + 16 * 2 + 2


def test_loaded_model_matches_numpy_reference_fed_the_npz(source):
    _, path = source
    model = small_vit()
    checkpoints.load_pretrained(model, path)
    images = random_images((3, 16, 16, 3))
    expected = numpy_vit.vit_forward(reference_params(checkpoints.read_npz(path)), 2, images)
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-5, rtol=1e-5)
    assert np.ptp(expected) > 0.1


def test_load_save_load_round_trip_is_exact(source, tmp_path):
    original, path = source
    loaded = small_vit()
    keras_vit.load_pretrained(loaded, path)
    images = random_images((2, 16, 16, 3))
    np.testing.assert_array_equal(loaded.predict(images, verbose=0), original.predict(images, verbose=0))
    keras_vit.save_npz(loaded, str(tmp_path / "again.npz"))
    first, second = checkpoints.read_npz(path), checkpoints.read_npz(str(tmp_path / "again.npz"))
    assert first.keys() == second.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])


def to_big_vision(params):
    """The vit_jax arrays in big_vision's naming (no class-token row in pos_embedding)."""
    out = {}
    for key, value in params.items():
        key = key.replace("MultiHeadDotProductAttention_1", "MultiHeadDotProductAttention_0")
        key = key.replace("LayerNorm_2", "LayerNorm_1").replace("MlpBlock_3", "MlpBlock_0")
        if key == "Transformer/posembed_input/pos_embedding":
            key, value = "pos_embedding", value[:, 1:]
        out[key] = value
    return out


def to_scan(params):
    """Blocks stacked on a leading axis under Transformer/encoderblock/."""
    out, blocks = {}, {}
    for key, value in params.items():
        if key.startswith("Transformer/encoderblock_"):
            index, rest = key[len("Transformer/encoderblock_") :].split("/", 1)
            blocks.setdefault(rest, {})[int(index)] = value
        else:
            out[key] = value
    for rest, values in blocks.items():
        out["Transformer/encoderblock/" + rest] = np.stack([values[i] for i in sorted(values)])
    return out


@pytest.mark.parametrize(
    "layout",
    [
        lambda p: {"params/" + k: v for k, v in p.items()},
        lambda p: {"opt/target/" + k: v for k, v in p.items()},
        to_scan,
        to_big_vision,
        lambda p: {"params/" + k: v for k, v in to_scan(to_big_vision(p)).items()},
    ],
    ids=["params_prefix", "opt_target_prefix", "scan", "big_vision", "big_vision_scan_prefixed"],
)
def test_every_key_layout_loads_to_the_same_model(source, tmp_path, layout):
    original, path = source
    # big_vision gives the class token no position: make the reference model's row zero too.
    encoder = original.get_layer("patch_encoder")
    posemb = encoder.position_embedding.numpy()
    posemb[:, 0] = 0.0
    encoder.position_embedding.assign(posemb)
    keras_vit.save_npz(original, path)
    variant_path = write_npz(layout(checkpoints.read_npz(path)), tmp_path / "layout.npz")
    loaded = small_vit()
    keras_vit.load_pretrained(loaded, variant_path)
    for key, value in weights_of(original).items():
        np.testing.assert_array_equal(weights_of(loaded)[key], value, err_msg=key)


def test_pre_logits_loaded_or_dropped(tmp_path):
    with_rep = randomize_weights(small_vit(representation_size=16), seed=2)
    path = str(tmp_path / "rep.npz")
    keras_vit.save_npz(with_rep, path)
    same = small_vit(representation_size=16)
    keras_vit.load_pretrained(same, path)
    np.testing.assert_array_equal(
        same.get_layer("pre_logits").kernel.numpy(), with_rep.get_layer("pre_logits").kernel.numpy()
    )
    plain = small_vit()
    notes = keras_vit.load_pretrained(plain, path)
    assert any("pre_logits/kernel" in note and "dropped" in note for note in notes)
    with pytest.raises(checkpoints.CheckpointError, match="pre_logits/kernel"):
        keras_vit.load_pretrained(small_vit(representation_size=16), write_npz(
            {k: v for k, v in checkpoints.read_npz(path).items() if not k.startswith("pre_logits")},
            tmp_path / "norep.npz",
        ))


def test_mismatched_head_is_left_zero_for_the_new_task(source):
    original, path = source
    model = small_vit(num_classes=7, head_kernel_initializer="zeros")
    notes = keras_vit.load_pretrained(model, path)
    assert any("(16, 5)" in note and "(16, 7)" in note for note in notes)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), 0.0)
    np.testing.assert_array_equal(
        model.get_layer("encoder_norm").gamma.numpy(), original.get_layer("encoder_norm").gamma.numpy()
    )
    before = weights_of(model)
    with pytest.raises(checkpoints.CheckpointError, match=r"\(16, 5\).*\(16, 7\)"):
        keras_vit.load_pretrained(small_vit(num_classes=7), path, skip_mismatched_head=False)
    backbone = small_vit(num_classes=None)
    assert any("head/kernel" in n for n in keras_vit.load_pretrained(backbone, path))
    assert before.keys() == weights_of(model).keys()


@pytest.mark.parametrize("image_size", [32, (16, 24)])
def test_loading_into_another_resolution_changes_only_the_position_embeddings(source, image_size):
    original, path = source
    model = small_vit(image_size=image_size)
    notes = keras_vit.load_pretrained(model, path, interpolation="bilinear")
    assert any("resampled" in note for note in notes)
    ours, theirs = weights_of(model), weights_of(original)
    for key in theirs:
        if key != "patch_encoder/position_embedding":
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    grid = model.get_layer("patch_encoder").grid_size
    expected = keras_vit.resample_position_embeddings(
        theirs["patch_encoder/position_embedding"], grid, "bilinear"
    )
    np.testing.assert_allclose(ours["patch_encoder/position_embedding"], expected, atol=1e-6)
    np.testing.assert_array_equal(expected[:, 0], theirs["patch_encoder/position_embedding"][:, 0])
    assert np.isfinite(model.predict(random_images((1, *model.input_shape[1:])), verbose=0)).all()


def test_gap_model_drops_the_class_token(source):
    original, path = source
    model = small_vit(classifier="gap")
    notes = keras_vit.load_pretrained(model, path)
    assert any("class token" in note for note in notes)
    np.testing.assert_array_equal(
        model.get_layer("patch_encoder").position_embedding.numpy(),
        original.get_layer("patch_encoder").position_embedding.numpy()[:, 1:],
    )


@pytest.mark.parametrize("interpolation", checkpoints.INTERPOLATIONS)
def test_resampling_to_the_same_grid_is_the_identity(interpolation):
    posemb = np.random.default_rng(0).normal(size=(1, 1 + 7 * 7, 8)).astype("float32")
    np.testing.assert_array_equal(keras_vit.resample_position_embeddings(posemb, (7, 7), interpolation), posemb)


@pytest.mark.parametrize("old_grid, new_grid", [((4, 4), (7, 9)), ((6, 5), (3, 8)), ((3, 3), (12, 12))])
def test_bilinear_reproduces_a_linear_field_inside_the_source_grid(old_grid, new_grid):
    def field(r, c):  # Two channels, each linear in the grid coordinates.
        return np.stack([0.7 * r - 1.3 * c + 0.2, -0.4 * r + 2.0 * c], axis=-1)

    r, c = np.meshgrid(np.arange(old_grid[0]), np.arange(old_grid[1]), indexing="ij")
    posemb = np.concatenate([np.full((1, 1, 2), 9.0), field(r, c).reshape(1, -1, 2)], axis=1)
    out = keras_vit.resample_position_embeddings(
        posemb, new_grid, "bilinear", old_grid=old_grid, num_prefix_tokens=1
    )
    np.testing.assert_array_equal(out[:, 0], posemb[:, 0])
    # Half-pixel centres: new index i samples the old grid at (i + 0.5) * old / new - 0.5.
    sr = (np.arange(new_grid[0]) + 0.5) * old_grid[0] / new_grid[0] - 0.5
    sc = (np.arange(new_grid[1]) + 0.5) * old_grid[1] / new_grid[1] - 0.5
    SR, SC = np.meshgrid(sr, sc, indexing="ij")
    inside = (SR >= 0) & (SR <= old_grid[0] - 1) & (SC >= 0) & (SC <= old_grid[1] - 1)
    assert inside.sum() >= 4
    got = out[0, 1:].reshape(*new_grid, 2)
    np.testing.assert_allclose(got[inside], field(SR, SC)[inside], atol=1e-12)


def test_zoom_is_scipy_order_one_and_bicubic_keeps_constants():
    from scipy import ndimage

    grid = np.random.default_rng(0).normal(size=(5, 5, 3))
    posemb = np.concatenate([np.zeros((1, 1, 3)), grid.reshape(1, 25, 3)], axis=1)
    zoomed = keras_vit.resample_position_embeddings(posemb, (8, 8), "zoom")
    np.testing.assert_allclose(zoomed[0, 1:].reshape(8, 8, 3), ndimage.zoom(grid, (1.6, 1.6, 1), order=1))
    constant = np.full((1, 16, 4), 0.25)
    np.testing.assert_allclose(keras_vit.resample_position_embeddings(constant, (7, 3), "bicubic"), 0.25)
    assert keras_vit.resample_position_embeddings(constant, (7, 3)).shape == (1, 21, 4)


def test_resample_argument_errors():
    with pytest.raises(ValueError, match="interpolation='nearest'"):
        keras_vit.resample_position_embeddings(np.zeros((1, 17, 4)), (5, 5), "nearest")
    with pytest.raises(ValueError, match="square grid"):
        keras_vit.resample_position_embeddings(np.zeros((1, 12, 4)), (5, 5), num_prefix_tokens=0)


def test_set_image_size(source):
    original, _ = source
    bigger = keras_vit.set_image_size(original, 32, interpolation="bilinear")
    assert bigger.input_shape == (None, 32, 32, 3) and bigger.name == original.name
    ours, theirs = weights_of(bigger), weights_of(original)
    for key in theirs:
        if key != "patch_encoder/position_embedding":
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    assert ours["patch_encoder/position_embedding"].shape == (1, 65, 16)
    same = keras_vit.set_image_size(original, 16)
    images = random_images((2, 16, 16, 3))
    np.testing.assert_array_equal(same.predict(images, verbose=0), original.predict(images, verbose=0))
    with pytest.raises(ValueError, match="divisible by the patch size"):
        keras_vit.set_image_size(original, 30)


def test_checkpoints_through_tf_gfile(source):
    """ram:// goes through tf.io.gfile like gs:// does."""
    original, _ = source
    keras_vit.save_npz(original, "ram://checkpoints/vit.npz")
    model = small_vit()
    keras_vit.load_pretrained(model, "ram://checkpoints/vit.npz")
    np.testing.assert_array_equal(weights_of(model)["head/kernel"], weights_of(original)["head/kernel"])


# === Bad input: clear errors, model unchanged ===


def test_missing_key_names_the_key_and_the_closest_present(source, tmp_path):
    _, path = source
    params = checkpoints.read_npz(path)
    del params["Transformer/encoderblock_1/MlpBlock_3/Dense_1/kernel"]
    assert_load_fails_unchanged(
        write_npz(params, tmp_path / "missing.npz"),
        r"no key 'Transformer/encoderblock_1/MlpBlock_3/Dense_1/kernel'; closest keys present: "
        r"\['Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel'",
    )


def test_shape_mismatch_names_the_key_and_both_shapes(source, tmp_path):
    _, path = source
    params = checkpoints.read_npz(path)
    params["Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"] = np.zeros((16, 31), "float32")
    assert_load_fails_unchanged(
        write_npz(params, tmp_path / "shape.npz"), r"'encoderblock_0/mlp_dense_1/kernel'.*\(16, 31\).*\(16, 32\)"
    )


def test_a_deeper_checkpoint_is_refused(source, tmp_path):
    _, path = source
    params = checkpoints.read_npz(path)
    for key in list(params):
        if "encoderblock_1/" in key:
            params[key.replace("encoderblock_1/", "encoderblock_2/")] = params[key]
    assert_load_fails_unchanged(write_npz(params, tmp_path / "deeper.npz"), r"no place for.*encoderblock_2")


def test_not_an_npz_and_truncated_files(source, tmp_path):
    _, path = source
    (tmp_path / "text.npz").write_text("definitely not a zip archive")
    assert_load_fails_unchanged(str(tmp_path / "text.npz"), "is not an .npz checkpoint")
    data = open(path, "rb").read()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    assert_load_fails_unchanged(str(tmp_path / "cut.npz"), "not an .npz checkpoint|truncated or corrupt")
    assert_load_fails_unchanged(str(tmp_path / "absent.npz"), "No checkpoint at", FileNotFoundError)
    assert_load_fails_unchanged(path, "interpolation='cubic'", ValueError, interpolation="cubic")


def test_a_pickled_object_is_refused_not_executed(source, tmp_path):
    _, path = source
    params = checkpoints.read_npz(path)
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    params["head/kernel"] = np.array([Payload()], dtype=object)
    buffer = io.BytesIO()
    np.savez(buffer, **params)
    (tmp_path / "pickled.npz").write_bytes(buffer.getvalue())
    assert_load_fails_unchanged(str(tmp_path / "pickled.npz"), "pickled Python object")
    assert not marker.exists()


# === Hybrids ===


@pytest.fixture(scope="module")
def hybrid():
    """A random R26+S/32 hybrid with one block at 64 px, built once for the tests that only read it."""
    return randomize_weights(keras_vit.build_vit("R26+S/32", image_size=64, num_classes=3, num_layers=1), scale=0.05)


def test_hybrid_checkpoint_keys_and_round_trip(hybrid, tmp_path):
    model = hybrid
    path = str(tmp_path / "hybrid.npz")
    keras_vit.save_npz(model, path)
    npz = checkpoints.read_npz(path)
    assert npz["conv_root/kernel"].shape == (7, 7, 3, 64)
    assert npz["gn_root/scale"].shape == (64,)
    assert npz["block1/unit1/conv_proj/kernel"].shape == (1, 1, 64, 256)
    assert npz["block4/unit2/gn3/bias"].shape == (2048,)
    assert npz["embedding/kernel"].shape == (1, 1, 2048, 384)
    loaded = keras_vit.build_vit("R26+S/32", image_size=64, num_classes=3, num_layers=1)
    keras_vit.load_pretrained(loaded, path)
    images = random_images((2, 64, 64, 3))
    # Called eagerly: predict() would trace and compile the ResNet stem for each model (about 5 s each here).
    outputs = [keras.ops.convert_to_numpy(m(images, training=False)) for m in (loaded, model)]
    np.testing.assert_array_equal(*outputs)
    del npz["block3/unit1/gn_proj/scale"]
    with pytest.raises(checkpoints.CheckpointError, match=r"no key 'block3/unit1/gn_proj/scale'"):
        keras_vit.load_pretrained(loaded, write_npz(npz, tmp_path / "broken.npz"))


def test_standardized_conv_matches_numpy():
    conv = keras_vit.StandardizedConv2D(4, 1, use_bias=False)
    x = np.random.default_rng(0).normal(size=(2, 3, 3, 5)).astype("float32")
    y = conv(x)
    w = conv.kernel.numpy().astype(np.float64)[0, 0]  # (5, 4), a 1x1 conv is a matmul
    w = (w - w.mean(0)) / (w.std(0) + 1e-5)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, atol=1e-5)


# === Transfer learning ===


def test_replace_head_and_freeze_backbone(source):
    original, _ = source
    model = keras_vit.replace_head(original, 10)
    assert model.output_shape == (None, 10)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), 0.0)
    assert model.get_layer("encoderblock_0") is original.get_layer("encoderblock_0")  # shared, not copied
    keras_vit.freeze_backbone(model)
    assert [w.path for w in model.trainable_weights] == ["head/kernel", "head/bias"]
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = weights_of(model)
    model.fit(random_images((8, 16, 16, 3)), np.arange(8) % 10, epochs=1, verbose=0)
    after = weights_of(model)
    changed = sorted(k for k in before if not np.array_equal(before[k], after[k]))
    assert changed == ["head/bias", "head/kernel"]
    assert keras_vit.replace_head(original, None).output_shape == (None, 16)


def test_set_image_size_takes_chains_of_layers_only(source, hybrid):
    original, _ = source
    # A hybrid's ResNet stem is one link of the chain.
    assert keras_vit.set_image_size(hybrid, 96).input_shape == (None, 96, 96, 3)
    # The backbone without its head is a chain too.
    backbone = keras_vit.replace_head(original, None)
    assert keras_vit.set_image_size(backbone, 32).output_shape == (None, 16)
    # A residual branch around a layer is not: each layer is called once, but not on the previous output.
    inputs = keras.Input((16, 16, 3))
    outputs = keras.layers.Add()([inputs, keras.layers.Conv2D(3, 1)(inputs)])
    with pytest.raises(ValueError, match=r"\(a chain of layers\); got 'residual'"):
        keras_vit.set_image_size(keras.Model(inputs, outputs, name="residual"), 32)
    stacked = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(3, 1)], name="stacked")
    with pytest.raises(ValueError, match=r"\(a chain of layers\); got 'stacked'"):
        keras_vit.set_image_size(stacked, 32)


def test_query_key_value_are_stacked_with_the_heads_on_the_last_axis(source):
    """convert_checkpoint builds the attention's (D, 3, D) kernel and (3, D) bias: q, k, v on the
    middle axis, head h in columns h * head_dim ... (h + 1) * head_dim of the last (what a cut of the
    last axis into equal pieces keeps whole); to_checkpoint also reads the flat (D, 3D) layout."""
    _, path = source
    params = checkpoints.canonicalize(checkpoints.read_npz(path))
    model = small_vit()
    shapes = {v.path: tuple(v.shape) for v in model.weights}
    weights, _ = checkpoints.convert_checkpoint(params, shapes, (4, 4))
    kernel, bias = weights["encoderblock_1/attention/qkv_kernel"], weights["encoderblock_1/attention/qkv_bias"]
    assert kernel.shape == (16, 3, 16) and bias.shape == (3, 16)
    attention = "Transformer/encoderblock_1/MultiHeadDotProductAttention_1/"
    for i, name in enumerate(("query", "key", "value")):
        for head in range(4):
            columns = slice(head * 4, (head + 1) * 4)
            np.testing.assert_array_equal(kernel[:, i, columns], params[f"{attention}{name}/kernel"][:, head])
            np.testing.assert_array_equal(bias[i, columns], params[f"{attention}{name}/bias"][head])
    flat = dict(weights)
    for path in [p for p in weights if p.endswith(("/qkv_kernel", "/qkv_bias"))]:
        flat[path] = weights[path].reshape(16, 48) if path.endswith("kernel") else weights[path].reshape(48)
    from_flat, from_stacked = checkpoints.to_checkpoint(flat, 4), checkpoints.to_checkpoint(weights, 4)
    assert from_flat.keys() == from_stacked.keys() == params.keys()
    for key in params:
        np.testing.assert_array_equal(from_flat[key], params[key])
        np.testing.assert_array_equal(from_stacked[key], params[key])


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (lambda v: np.full(v.shape, "x"), r"'head/bias' holds str\d* values \(shape \(5,\)\); expected floating-point"),
        (lambda v: v.astype(np.complex64) + 1j, r"'head/bias' holds complex64 values .*expected floating-point"),
        (lambda v: np.where(np.arange(v.size) % 2, np.nan, v).reshape(v.shape), r"'head/bias' .* holds 2 NaN"),
        (lambda v: np.arange(v.size).reshape(v.shape), r"'head/bias' holds int64 values"),
    ],
    ids=["string", "complex", "nan", "integer"],
)
def test_an_array_that_is_not_finite_floating_point_is_refused_before_any_weight_is_set(
    source, tmp_path, bad, pattern
):
    """The head comes last among the weights: without the checks up front, every block would be loaded
    (and the model changed) before the head failed."""
    _, path = source
    params = checkpoints.read_npz(path)
    params["head/bias"] = bad(params["head/bias"])
    assert_load_fails_unchanged(write_npz(params, tmp_path / "bad.npz"), pattern)


def test_a_checkpoint_of_another_head_count_is_refused(tmp_path):
    two_heads = randomize_weights(small_vit(num_heads=2), seed=3)
    path = str(tmp_path / "two_heads.npz")
    keras_vit.save_npz(two_heads, path)
    # Same width (16), so every shape but the per-head split agrees: it would load silently into 4 heads.
    assert_load_fails_unchanged(path, r"encoderblock_0/.*/query/kernel' has shape \(16, 2, 8\): 2 attention heads; "
                                      r"the model has 4. Build it with num_heads=2")


def test_a_directory_an_empty_file_and_a_non_square_grid_each_get_their_own_message(source, tmp_path):
    assert_load_fails_unchanged(str(tmp_path), r"is a directory; expected a checkpoint file")
    (tmp_path / "empty.npz").write_bytes(b"")
    assert_load_fails_unchanged(str(tmp_path / "empty.npz"), r"is empty \(0 bytes\)")
    _, path = source
    params = checkpoints.read_npz(path)
    posemb = "Transformer/posembed_input/pos_embedding"
    params[posemb] = np.concatenate([params[posemb], params[posemb][:, 1:3]], axis=1)  # 1 + 18 rows
    assert_load_fails_unchanged(
        write_npz(params, tmp_path / "grid.npz"), r"has 18 patch rows, not a square grid, and the model's grid is 4x4",
        model={"image_size": 16},
    )


def test_a_zip_bomb_and_an_empty_archive_are_refused_before_decompressing(source, tmp_path):
    import zipfile

    model, path = source
    limit = checkpoints.checkpoint_bytes_limit(model)
    assert limit == 16 * sum(int(np.prod(v.shape)) for v in model.weights if "seed_generator" not in v.path) + 2**20
    # 64 MiB of zeros behind an .npy header, deflated to about 64 KiB: 40x this model's limit.
    bomb = tmp_path / "bomb.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**24,)})
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive, archive.open("head/bias.npy", "w") as f:
        f.write(header.getvalue())
        for _ in range(64):
            f.write(bytes(2**20))
    assert bomb.stat().st_size < 2**20 < limit
    assert_load_fails_unchanged(
        str(bomb), r"declares 67,108,\d{3} bytes of arrays once decompressed \('head/bias.npy'.*refused before"
    )
    # A file larger than the limit is not even read.
    big = tmp_path / "big.npz"
    big.write_bytes(bytes(limit + 1))
    assert_load_fails_unchanged(str(big), r"more than a checkpoint of this model can hold .*refused before reading")
    empty = tmp_path / "empty_archive.npz"
    np.savez(empty)
    assert_load_fails_unchanged(str(empty), r"an .npz archive of no array")


@pytest.mark.parametrize("interpolation", ["bicubic_antialias", "bilinear", "bicubic"])
def test_flexivit_resize_embeds_a_resized_patch_as_the_original(interpolation):
    """FlexiViT's pseudo-inverse resize (Beyer et al. 2023): with B the patch resize, a larger patch size gives
    <B x, w'> = <x, w> for every patch x; a smaller one the least-squares w' (the normal equations B B^T w' = B w)."""
    from keras_vit.checkpoints.resample import interpolation_matrix

    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(4, 4, 3, 5))
    for new in (6, 8, 3, 2):
        resize = np.kron(*(interpolation_matrix(4, new, interpolation),) * 2)  # (new*new, 16)
        resized = checkpoints.resize_patch_kernel(kernel, (new, new), interpolation)
        assert resized.shape == (new, new, 3, 5)
        w, w_new = kernel.reshape(16, -1), resized.reshape(new * new, -1)
        if new > 4:
            patches = rng.normal(size=(7, 16))
            np.testing.assert_allclose((patches @ resize.T) @ w_new, patches @ w, atol=1e-9)
        else:
            np.testing.assert_allclose(resize @ resize.T @ w_new, resize @ w, atol=1e-9)
    with pytest.raises(ValueError, match="interpolation='nearest'"):
        checkpoints.resize_patch_kernel(kernel, (8, 8), "nearest")


def test_set_patch_size_gives_a_model_that_sees_the_upsampled_image_as_the_original():
    """A 16 px model with 4 px patches made into one with 8 px patches at 32 px (the same 4 x 4 grid): on the
    image whose every patch is upsampled by the resize the kernel was inverted for, the same logits; the spec,
    class names and the other weights carried over."""
    from keras_vit.checkpoints.resample import interpolation_matrix

    names = [f"c{i}" for i in range(5)]
    model = randomize_weights(small_vit(class_names=names, num_registers=2))
    images = random_images((2, 16, 16, 3))
    resize = interpolation_matrix(4, 8, "bicubic_antialias")  # (8, 4)
    patches = images.reshape(2, 4, 4, 4, 4, 3)  # (batch, grid row, row, grid column, column, channel)
    upsampled = np.einsum("ar,bc,nirjcd->niajbd", resize, resize, patches).reshape(2, 32, 32, 3)
    larger = keras_vit.set_patch_size(model, 8, image_size=32)
    assert larger.spec == model.spec.replace(patch_size=(8, 8), image_size=(32, 32))
    np.testing.assert_allclose(larger.predict(upsampled, verbose=0), model.predict(images, verbose=0), atol=1e-4)
    np.testing.assert_array_equal(larger.get_layer("head").kernel.numpy(), model.get_layer("head").kernel.numpy())
    # The same image size, another grid: positions resampled; a hybrid refused.
    assert keras_vit.set_patch_size(model, 2).get_layer("patch_encoder").grid_size == (8, 8)
    with pytest.raises(ValueError, match="hybrid"):
        keras_vit.set_patch_size(keras_vit.build_vit("R+Ti/16", image_size=32, num_classes=2), 8)
