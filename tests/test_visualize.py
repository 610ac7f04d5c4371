import math
import struct

import numpy as np
import pytest
from sklearn.decomposition import PCA

import keras_vit
from keras_vit import visualize
from keras_vit.testing import random_images, randomize_weights
from tests import numpy_vit
from tests.builders import SMALL, small_vit

# A grid of 2 x 3 patches: the maps and distances must keep height and width apart.
RECTANGLE = (8, 12)
LAYERS = SMALL["num_layers"]


def random_small_vit(**options):
    """The small model with random weights everywhere (its norms and biases too)."""
    return randomize_weights(small_vit(**options))


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_attention_weights_match_numpy_reference(classifier):
    model = random_small_vit(image_size=RECTANGLE, classifier=classifier)
    images = random_images((5, 8, 12, 3))
    got = visualize.attention_weights(model, images, batch_size=2)
    tokens = 6 + (classifier == "token")
    assert got.shape == (LAYERS, 5, 4, tokens, tokens)
    params, num_layers = numpy_vit.params_from_model(model)
    expected = []
    numpy_vit.vit_forward(params, num_layers, images, classifier=classifier, attention=expected)
    np.testing.assert_allclose(got, np.stack(expected), atol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
    assert got.std() > 0.01  # Not uniform: the test would pass for any model otherwise.


def test_attention_weights_of_a_reloaded_model(tmp_path):
    model = random_small_vit(image_size=RECTANGLE)
    images = random_images((2, 8, 12, 3))
    model.save(tmp_path / "m.keras")
    import keras

    restored = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(
        visualize.attention_weights(restored, images), visualize.attention_weights(model, images)
    )


def test_bad_images_are_refused():
    model = random_small_vit(image_size=RECTANGLE)
    with pytest.raises(ValueError, match=r"\(batch, 8, 12, 3\).*\(2, 12, 8, 3\)"):
        visualize.attention_weights(model, np.zeros((2, 12, 8, 3)))
    single = visualize.attention_weights(model, np.zeros((8, 12, 3)))
    assert single.shape[1] == 1


def uniform_attention(layers, heads, tokens):
    return np.full((layers, 1, heads, tokens, tokens), 1.0 / tokens)


@pytest.mark.parametrize(
    "grid, patch, expected",
    [
        # 2x2 grid: from each patch, distances 0, P, P, P*sqrt(2).
        ((2, 2), (4, 4), 4 * (2 + math.sqrt(2)) / 4),
        # 1x3 grid: end patches average P, the middle one 2P/3.
        ((1, 3), (5, 5), 5 * 8 / 9),
        # Rectangular patches, 2x1 grid: the two centres are 6 pixels apart.
        ((2, 1), (6, 2), 6 / 2),
    ],
)
@pytest.mark.parametrize("class_token", [True, False])
def test_uniform_attention_gives_the_grid_mean_distance(grid, patch, expected, class_token):
    tokens = grid[0] * grid[1] + class_token
    distances = visualize.mean_distance(uniform_attention(2, 3, tokens), grid, patch, class_token)
    assert distances.shape == (2, 3)
    np.testing.assert_allclose(distances, expected, rtol=1e-12)


def test_attention_to_itself_gives_distance_zero():
    tokens = 1 + 12
    identity = np.broadcast_to(np.eye(tokens), (2, 1, 4, tokens, tokens))
    np.testing.assert_array_equal(visualize.mean_distance(identity, (3, 4), (4, 4), True), 0.0)


def test_attention_to_the_neighbour_gives_its_distance():
    # 1x4 grid of 8-pixel patches, each query attends to the next patch (the last to the one before).
    attention = np.zeros((1, 1, 1, 4, 4))
    for q, k in enumerate([1, 2, 3, 2]):
        attention[0, 0, 0, q, k] = 1.0
    np.testing.assert_allclose(visualize.mean_distance(attention, (1, 4), (8, 8), False), 8.0)


def test_mean_attention_distance_of_a_model():
    model = random_small_vit(image_size=RECTANGLE)
    distances = visualize.mean_attention_distance(model, random_images((3, 8, 12, 3)))
    assert distances.shape == (LAYERS, 4)
    farthest = math.hypot(4, 8)  # Two opposite corner patches of the 2x3 grid of 4x4 patches.
    assert np.all(distances > 0) and np.all(distances < farthest)


def test_rollout_of_identity_attention_is_the_identity():
    tokens = 5
    identity = np.broadcast_to(np.eye(tokens), (3, 2, 4, tokens, tokens))
    for fusion in visualize.HEAD_FUSIONS:
        np.testing.assert_allclose(visualize.rollout(identity, fusion), np.broadcast_to(np.eye(tokens), (2, 5, 5)))


def test_rollout_multiplies_layers_with_the_residual():
    rng = np.random.default_rng(0)
    a = rng.random((2, 1, 2, 4, 4))
    a /= a.sum(-1, keepdims=True)
    fused = [0.5 * (a[layer, 0].mean(0) + np.eye(4)) for layer in range(2)]  # rows of A + I sum to 2
    np.testing.assert_allclose(visualize.rollout(a)[0], fused[1] @ fused[0], atol=1e-12)
    joint = visualize.rollout(a, "max", discard_ratio=0.5)
    np.testing.assert_allclose(joint.sum(-1), 1.0)


def test_rollout_discards_the_weakest_entries_but_not_the_class_token_column():
    attention = np.zeros((1, 1, 1, 3, 3))
    attention[0, 0, 0] = [[0.04, 0.9, 0.06], [0.05, 0.02, 0.93], [0.9, 0.03, 0.07]]
    joint = visualize.rollout(attention, discard_ratio=0.6)
    # The weakest 5 of 9 entries (int(9 * 0.6) = 5) are 0.02 ... 0.06; those in column 0 stay.
    kept = np.array([[0.04, 0.9, 0.0], [0.05, 0.0, 0.93], [0.9, 0.0, 0.07]]) + np.eye(3)
    np.testing.assert_allclose(joint[0], kept / kept.sum(-1, keepdims=True))


@pytest.mark.parametrize("classifier", ["token", "gap"])
@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_attention_rollout_maps(classifier, fusion):
    model = random_small_vit(image_size=RECTANGLE, classifier=classifier)
    maps = visualize.attention_rollout(model, random_images((2, 8, 12, 3)), head_fusion=fusion, discard_ratio=0.2)
    assert maps.shape == (2, 8, 12)
    assert np.isfinite(maps).all() and maps.min() >= 0.0 and maps.max() <= 1.0
    assert np.isclose(maps.max(), 1.0, atol=1e-3)


def test_rollout_argument_errors():
    with pytest.raises(ValueError, match="head_fusion='sum'"):
        visualize.rollout(uniform_attention(1, 1, 3), head_fusion="sum")
    with pytest.raises(ValueError, match="discard_ratio=1.0"):
        visualize.rollout(uniform_attention(1, 1, 3), discard_ratio=1.0)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        visualize.rollout(np.eye(3))


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_position_embedding_similarity(classifier):
    model = random_small_vit(classifier=classifier, image_size=(12, 16))
    similarity = visualize.position_embedding_similarity(model)
    assert similarity.shape == (3, 4, 3, 4)
    flat = similarity.reshape(12, 12)
    np.testing.assert_allclose(np.diag(flat), 1.0, atol=1e-12)
    np.testing.assert_allclose(flat, flat.T, atol=1e-12)
    assert flat.min() >= -1.0 - 1e-12 and flat.max() <= 1.0 + 1e-12


def test_the_similarity_figure_tiles_each_patchs_map_at_its_position():
    """plot_position_similarity draws one image: patch (i, j)'s (gh, gw) map in tile (i, j), tiles one NaN pixel
    apart (the background)."""
    from keras_vit.visualize.figures import similarity_mosaic

    similarity = np.random.default_rng(0).uniform(-1, 1, (3, 4, 3, 4))
    mosaic = similarity_mosaic(similarity)
    assert mosaic.shape == (3 * 4 - 1, 4 * 5 - 1)
    for i in range(3):
        for j in range(4):
            np.testing.assert_array_equal(mosaic[i * 4:i * 4 + 3, j * 5:j * 5 + 4], similarity[i, j].astype(np.float32))
    gaps = np.isnan(mosaic)
    assert gaps[3::4].all() and gaps[:, 4::5].all() and gaps.sum() == mosaic.size - similarity.size


def test_neighbour_similarity_sees_a_grid_structure():
    model = random_small_vit(image_size=(16, 16), classifier="gap")
    encoder = model.get_layer("patch_encoder")
    # Embeddings that vary smoothly with the position: neighbours are similar, far patches not.
    rows, cols = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
    freqs = np.linspace(0.3, 1.2, 4)
    smooth = np.concatenate(
        [np.sin(f * rows.ravel()[:, None] + [0, 1]) for f in freqs]
        + [np.cos(f * cols.ravel()[:, None] + [0, 1]) for f in freqs],
        axis=1,
    )
    encoder.position_embedding.assign(smooth[None].astype("float32"))
    scores = visualize.neighbour_similarity(visualize.position_embedding_similarity(model))
    assert scores["position_similarity_neighbours"] > scores["position_similarity_distant"] + 0.3
    # Random embeddings have no such structure.
    encoder.position_embedding.assign(np.random.default_rng(0).normal(size=(1, 16, 16)).astype("float32"))
    scores = visualize.neighbour_similarity(visualize.position_embedding_similarity(model))
    assert abs(scores["position_similarity_neighbours"] - scores["position_similarity_distant"]) < 0.2


def test_patch_embedding_filters_are_the_principal_components():
    model = random_small_vit(hidden_dim=64, num_heads=4, patch_size=2, image_size=RECTANGLE)
    filters = visualize.patch_embedding_filters(model, num_components=6)
    assert filters.shape == (6, 2, 2, 3)
    flat = filters.reshape(6, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(6), atol=1e-10)
    # Independent check: scikit-learn's PCA of the 64 filters, up to the sign of each component.
    kernel = model.get_layer("patch_encoder").kernel.numpy().reshape(-1, 64).T.astype(np.float64)
    reference = PCA(n_components=6).fit(kernel).components_
    np.testing.assert_allclose(np.abs((flat * reference).sum(-1)), 1.0, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[1, 12\].*num_components=13"):
        visualize.patch_embedding_filters(model, num_components=13)


@pytest.mark.parametrize("channels", [3, 1])
def test_the_filters_figure_shows_each_filter_scaled_to_its_own_range_in_order(tmp_path, monkeypatch, channels):
    """One image: filter k at row k // 7, column k % 7, each pixel a 6x6 block (24 / 4 pixels), 3-pixel white
    gaps between them; a one-channel filter in grey."""
    import matplotlib.axes

    filters = np.random.default_rng(0).normal(size=(9, 3, 4, channels))
    drawn, imshow = [], matplotlib.axes.Axes.imshow
    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", lambda self, x, **kw: drawn.append(x) or imshow(self, x, **kw))
    assert visualize.plot_filters(filters, tmp_path / "filters.png") == str(tmp_path / "filters.png")
    (canvas,) = drawn
    assert canvas.shape == (2 * 18 + 3, 7 * 24 + 6 * 3, 3)
    painted = np.zeros(canvas.shape[:2], bool)
    for k, component in enumerate(filters):
        top, left = (k // 7) * 21, (k % 7) * 27
        expected = (component - component.min()) / (component.max() - component.min())
        expected = np.broadcast_to(expected, (3, 4, 3)).repeat(6, axis=0).repeat(6, axis=1)
        np.testing.assert_allclose(canvas[top:top + 18, left:left + 24], expected, atol=1e-6, err_msg=str(k))
        painted[top:top + 18, left:left + 24] = True
    np.testing.assert_array_equal(canvas[~painted], 1.0)  # The gaps and the empty slots are white.
    assert (tmp_path / "filters.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_are_written_as_png_files(tmp_path):
    model = random_small_vit(image_size=RECTANGLE)
    image = random_images((8, 12, 3))
    paths = visualize.write_figures(model, image, tmp_path, prefix="x_")
    names = sorted(p.split("/")[-1] for p in paths)
    assert names == sorted(
        "x_" + n
        for n in [
            "patch_grid.png",
            "attention_rollout.png",
            "head_attention.png",
            "mean_attention_distance.png",
            "position_similarity.png",
            "embedding_filters.png",
        ]
    )
    sizes = {name: png_size(tmp_path / name) for name in names}
    assert sizes["x_attention_rollout.png"] == (900, 320)  # figsize (9, 3.2) at 100 dpi
    assert sizes["x_mean_attention_distance.png"] == (500, 400)
    assert sizes["x_head_attention.png"] == (800, 400)  # 4 heads: 4 columns, 2 rows of 2 inches
    for name in names:
        import matplotlib.image

        pixels = matplotlib.image.imread(tmp_path / name)
        assert pixels.shape[:2] == sizes[name][::-1]
        assert pixels.std() > 0.01  # Something was drawn.


def test_hybrid_models_measure_distance_in_input_pixels(tmp_path):
    model = randomize_weights(keras_vit.build_vit("R+Ti/16", image_size=64, num_classes=3, num_layers=2), scale=0.05)
    images = random_images((2, 64, 64, 3))
    attention = visualize.attention_weights(model, images)
    assert attention.shape == (2, 2, 3, 5, 5)  # 64 px / (ResNet stride 4 * patch 8) = 2x2 patches
    np.testing.assert_allclose(
        visualize.mean_attention_distance(model, images),
        visualize.mean_distance(attention, (2, 2), (32, 32), True),
    )
    with pytest.raises(ValueError, match="hybrid"):
        visualize.patch_embedding_filters(model)
    sequence = visualize.patch_sequence(model, images[0])
    assert sequence.grid_size == (2, 2) and sequence.patch_size == (32, 32)  # a feature-map cell in pixels
    assert sequence.boxes.tolist() == [[0, 0, 32, 32], [0, 32, 32, 64], [32, 0, 64, 32], [32, 32, 64, 64]]
    assert sequence.positions.tolist() == [1, 2, 3, 4]
    paths = visualize.write_figures(model, images[0], tmp_path)
    assert len(paths) == 5 and paths[0].endswith("/patch_grid.png")


# === The patch sequence ===


@pytest.mark.parametrize("classifier", ["token", "gap"])
@pytest.mark.parametrize("patch_size", [16, (8, 16)])
def test_patch_sequence_is_the_order_the_model_embeds(classifier, patch_size):
    import keras

    height, width = 48, 32
    model = random_small_vit(image_size=(height, width), patch_size=patch_size, classifier=classifier)
    image = random_images((height, width, 3)) / 127.5 - 1.0
    sequence = visualize.patch_sequence(model, image)
    ph, pw = (patch_size, patch_size) if isinstance(patch_size, int) else patch_size
    gh, gw = height // ph, width // pw
    count = gh * gw
    class_token = classifier == "token"
    assert sequence.grid_size == (gh, gw) and sequence.patch_size == (ph, pw)
    assert sequence.class_token == class_token
    assert sequence.patches.shape == (count, ph, pw, 3)
    # The same pixels, in the same order, as the library's own patch extraction.
    patches = keras.ops.convert_to_numpy(keras_vit.layers.Patches(patch_size)(image[None]))[0]
    np.testing.assert_array_equal(sequence.patches.reshape(count, -1), patches)
    # And as the model's patch encoder (its conv projection): token k + class token is patch k embedded.
    encoder = model.get_layer("patch_encoder")
    tokens = keras.ops.convert_to_numpy(encoder(image[None]))[0].astype(np.float64)
    tokens -= encoder.position_embedding.numpy()[0]
    kernel = encoder.kernel.numpy().astype(np.float64).reshape(-1, tokens.shape[-1])
    expected = sequence.patches.reshape(count, -1).astype(np.float64) @ kernel + encoder.bias.numpy()
    np.testing.assert_allclose(tokens[int(class_token):], expected, atol=1e-4)
    # Positions index the position embedding's rows; the class token holds row 0.
    assert sequence.positions.tolist() == list(range(int(class_token), count + int(class_token)))
    assert encoder.position_embedding.shape[1] == count + int(class_token)
    # The boxes tile the image without overlap, row-major, each holding its patch's pixels.
    covered = np.zeros((height, width), int)
    for (top, left, bottom, right), patch in zip(sequence.boxes, sequence.patches):
        assert (bottom - top, right - left) == (ph, pw)
        covered[top:bottom, left:right] += 1
        np.testing.assert_array_equal(image[top:bottom, left:right], patch)
    np.testing.assert_array_equal(covered, 1)
    assert sequence.boxes[1].tolist() == ([0, pw, ph, 2 * pw] if gw > 1 else [ph, 0, 2 * ph, pw])


def test_patch_sequence_from_a_patch_size():
    image = random_images((12, 8))  # grayscale, no channel axis
    sequence = visualize.patch_sequence((4, 8), image)
    assert sequence.class_token and sequence.positions.tolist() == [1, 2, 3]
    assert sequence.patches.shape == (3, 4, 8, 1)
    np.testing.assert_array_equal(sequence.patches[2, ..., 0], image[8:12])
    gap = visualize.patch_sequence(4, image[None, ..., None], class_token=False)
    assert gap.grid_size == (3, 2) and gap.positions.tolist() == list(range(6))


def test_patch_sequence_errors():
    with pytest.raises(ValueError, match=r"multiple of 16.*multiple of 16.*\(50, 32\), patch_size=\(16, 16\)"):
        visualize.patch_sequence(16, np.zeros((50, 32, 3)))
    with pytest.raises(ValueError, match=r"multiple of 8 and a width that is a multiple of 5.*\(16, 12\)"):
        visualize.patch_sequence((8, 5), np.zeros((16, 12, 3)))
    with pytest.raises(ValueError, match="patch_size=0"):
        visualize.patch_sequence(0, np.zeros((16, 16, 3)))
    with pytest.raises(ValueError, match=r"shape \(2, 16, 16, 3\)"):
        visualize.patch_sequence(8, np.zeros((2, 16, 16, 3)))
    model = random_small_vit(image_size=RECTANGLE, classifier="gap")
    with pytest.raises(ValueError, match="has no class token.*class_token=True"):
        visualize.patch_sequence(model, np.zeros((8, 12, 3)), class_token=True)
    with pytest.raises(ValueError, match=r"\(batch, 8, 12, 3\).*\(1, 8, 16, 3\)"):
        visualize.patch_sequence(model, np.zeros((8, 16, 3)))


@pytest.mark.parametrize("shape, patch_size, class_token", [((48, 32, 3), (8, 16), True), ((16, 16, 1), 2, False)])
def test_patch_grid_figure(tmp_path, shape, patch_size, class_token):
    import matplotlib.image

    image = random_images(shape)
    sequence = visualize.patch_sequence(patch_size, image, class_token=class_token)
    path = visualize.plot_patch_grid(image, sequence, tmp_path / "grid.png")
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert png_size(path) == pixels.shape[1::-1]
    assert pixels.std() > 0.01  # Something was drawn.
    with pytest.raises(ValueError, match="columns=0"):
        visualize.plot_patch_grid(image, sequence, tmp_path / "x.png", columns=0)
    with pytest.raises(ValueError, match=r"does not cover.*\(32, 48\)"):
        visualize.plot_patch_grid(np.zeros((32, 48, 3)), sequence, tmp_path / "x.png")


def test_save_figure_writes_a_whole_png_locally_and_on_a_file_system_url(tmp_path):
    import tensorflow as tf

    plt = visualize.pyplot()
    for path in (tmp_path / "figure.png", "ram://figures/figure.png"):
        figure, ax = plt.subplots(figsize=(3, 2))
        ax.plot([0, 1], [1, 0])
        assert visualize.save_figure(figure, path) == str(path)
        assert not plt.fignum_exists(figure.number)  # Closed: a long job does not accumulate figures.
        data = tf.io.gfile.GFile(str(path), "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (300, 200)  # 100 dpi
        # Written under a temporary name, then renamed: nothing else is left beside it.
        assert tf.io.gfile.listdir(str(path).rsplit("/", 1)[0]) == ["figure.png"]


def test_the_package_keeps_its_names_and_its_modules_import_one_way():
    import importlib
    import pathlib
    import re

    expected = {
        "HEAD_FUSIONS", "PatchSequence", "attention_rollout", "attention_weights", "mean_attention_distance",
        "mean_distance", "neighbour_similarity", "patch_distances", "patch_embedding_filters", "patch_sequence",
        "plot_attention_rollout", "plot_filters", "plot_head_attention", "plot_mean_distance", "plot_patch_grid",
        "plot_position_similarity", "position_embedding_similarity", "pyplot", "rollout", "save_figure",
        "write_figures",
    }
    assert set(visualize.__all__) == expected and all(hasattr(visualize, name) for name in expected)
    # The analysis needs no figure: it imports nothing of the figures (nor matplotlib).
    analysis = pathlib.Path(importlib.import_module("keras_vit.visualize.analysis").__file__).read_text()
    assert not re.search(r"import .*(figures|matplotlib)|from keras_vit.visualize", analysis)


@pytest.mark.parametrize("module", ["keras_vit.visualize", "keras_vit.visualize.analysis"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), verbose=False)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("options", [dict(num_registers=2), dict(distillation="token"),
                                     dict(num_registers=3, classifier="gap"), dict(classifier="gap", class_token=True)],
                         ids=["registers", "distilled", "gap", "unread_class_token"])  # fmt: skip
def test_the_figures_read_the_patch_tokens_behind_register_and_distillation_tokens(tmp_path, options):
    """With tokens before the patches (registers, DeiT's distillation token), the maps, distances and position
    similarities are those of the patches: the same numbers as computed by hand from the attention with the extra
    tokens left out."""
    model = random_small_vit(image_size=RECTANGLE, **options)
    images = random_images((2, 8, 12, 3))
    encoder = model.get_layer("patch_encoder")
    prefix, positioned = encoder.num_prefix_tokens, encoder.num_positioned_prefix
    attentions = visualize.attention_weights(model, images)
    assert attentions.shape[-1] == 6 + prefix
    np.testing.assert_allclose(
        visualize.mean_attention_distance(model, images),
        visualize.mean_distance(attentions[..., prefix:, prefix:], (2, 3), (4, 4), False), atol=1e-12,
    )
    posemb = encoder.position_embedding.numpy()[0, positioned:]
    unit = posemb / np.linalg.norm(posemb, axis=-1, keepdims=True)
    np.testing.assert_allclose(visualize.position_embedding_similarity(model).reshape(6, 6), unit @ unit.T, atol=1e-6)
    assert visualize.patch_sequence(model, images[0]).positions.tolist() == list(range(positioned, positioned + 6))
    maps = visualize.attention_rollout(model, images)
    assert maps.shape == (2, 8, 12) and np.isclose(maps.max(), 1.0, atol=1e-3)
    assert len(visualize.write_figures(model, images[0], tmp_path)) == 6
