"""Checkpoints in big_vision's layout (big_vision/models/vit.py): fixed 2-D sin-cos position embeddings and the MAP
head, written with NumPy, load into the model built with the same options and give big_vision's forward pass;
options that do not match the model are named."""

import numpy as np
import pytest

import keras_vit
from keras_vit import checkpoints
from keras_vit.testing import random_images
from tests import numpy_vit
from tests.builders import assert_load_fails_unchanged, small_vit, weights_of, write_npz


def big_vision_checkpoint(seed, *, posemb="sincos2d", pool="map", dim=16, depth=2, heads=4, mlp=32, classes=5):
    """Random arrays named and shaped as big_vision's ViT parameters (big_vision/models/vit.py:
    `embedding` conv, `pos_embedding` (1, patches, D) only when learned, `Transformer/encoderblock_i/
    {LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0}`, `Transformer/encoder_norm`,
    `MAPHead_0` for pool_type "map", `cls` for "tok", `head`), under big_vision's `params/` prefix."""
    rng = np.random.default_rng(seed)
    shapes = {"embedding/kernel": (4, 4, 3, dim), "embedding/bias": (dim,), "head/kernel": (dim, classes)}
    shapes["head/bias"] = (classes,)
    if posemb == "learn":
        shapes["pos_embedding"] = (1, 16, dim)  # 16 px images, 4 x 4 patches
    if pool == "tok":
        shapes["cls"] = (1, 1, dim)
    blocks = [f"Transformer/encoderblock_{i}/" for i in range(depth)] + ["Transformer/"]
    for prefix in blocks[:-1]:
        for norm in ("LayerNorm_0", "LayerNorm_1"):
            shapes[f"{prefix}{norm}/scale"] = shapes[f"{prefix}{norm}/bias"] = (dim,)
        for name in ("query", "key", "value"):
            shapes[f"{prefix}MultiHeadDotProductAttention_0/{name}/kernel"] = (dim, heads, dim // heads)
            shapes[f"{prefix}MultiHeadDotProductAttention_0/{name}/bias"] = (heads, dim // heads)
        shapes[f"{prefix}MultiHeadDotProductAttention_0/out/kernel"] = (heads, dim // heads, dim)
        shapes[f"{prefix}MultiHeadDotProductAttention_0/out/bias"] = (dim,)
        for i, (fan_in, fan_out) in enumerate([(dim, mlp), (mlp, dim)]):
            shapes[f"{prefix}MlpBlock_0/Dense_{i}/kernel"] = (fan_in, fan_out)
            shapes[f"{prefix}MlpBlock_0/Dense_{i}/bias"] = (fan_out,)
    shapes["Transformer/encoder_norm/scale"] = shapes["Transformer/encoder_norm/bias"] = (dim,)
    params = {key: rng.normal(0.0, 0.2, shape) + key.endswith("/scale") for key, shape in shapes.items()}
    if pool == "map":
        params.update({f"MAPHead_0/{k}": v for k, v in numpy_vit.random_map_head_params(rng, dim, heads, mlp).items()})
    return {f"params/{key}": value.astype("float32") for key, value in params.items()}


def numpy_big_vision_forward(params, images, gelu):
    """big_vision's ViT forward pass in float64 on its own parameter names: patches, + position
    embeddings (sin-cos if the file has none), then the class token, pre-norm blocks, encoder_norm,
    the MAP head (or the class token, or the mean), head."""
    p = {key[len("params/") :]: np.asarray(value, np.float64) for key, value in params.items()}
    x = np.asarray(images, np.float64) / 127.5 - 1.0
    n, ph, dim = len(x), p["embedding/kernel"].shape[0], p["embedding/kernel"].shape[-1]
    gh, gw = x.shape[1] // ph, x.shape[2] // ph
    x = x.reshape(n, gh, ph, gw, ph, 3).transpose(0, 1, 3, 2, 4, 5).reshape(n, gh * gw, -1)
    x = x @ p["embedding/kernel"].reshape(-1, dim) + p["embedding/bias"]
    x = x + p.get("pos_embedding", numpy_vit.posemb_sincos_2d(gh, gw, dim))
    if "cls" in p:
        x = np.concatenate([np.repeat(p["cls"], n, axis=0), x], axis=1)
    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in p:
        prefix = f"Transformer/encoderblock_{i}/"
        y = numpy_vit.layer_norm(x, p[prefix + "LayerNorm_0/scale"], p[prefix + "LayerNorm_0/bias"])
        attention = prefix + "MultiHeadDotProductAttention_0/"
        out = np.zeros_like(x) + p[attention + "out/bias"]
        for h in range(p[attention + "query/kernel"].shape[1]):
            q, k, v = (
                y @ p[f"{attention}{name}/kernel"][:, h] + p[f"{attention}{name}/bias"][h]
                for name in ("query", "key", "value")
            )
            weights = numpy_vit.softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]))
            out += weights @ v @ p[attention + "out/kernel"][h]
        x = x + out
        y = numpy_vit.layer_norm(x, p[prefix + "LayerNorm_1/scale"], p[prefix + "LayerNorm_1/bias"])
        y = gelu(y @ p[prefix + "MlpBlock_0/Dense_0/kernel"] + p[prefix + "MlpBlock_0/Dense_0/bias"])
        x = x + y @ p[prefix + "MlpBlock_0/Dense_1/kernel"] + p[prefix + "MlpBlock_0/Dense_1/bias"]
        i += 1
    x = numpy_vit.layer_norm(x, p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"])
    if "MAPHead_0/probe" in p:
        head = {k[len("MAPHead_0/") :]: v for k, v in p.items() if k.startswith("MAPHead_0/")}
        pooled = numpy_vit.map_head(x, head, gelu)
    else:
        pooled = x[:, 0] if "cls" in p else x.mean(axis=1)
    return pooled @ p["head/kernel"] + p["head/bias"]


@pytest.mark.parametrize(
    "posemb, pool, kwargs",
    [
        ("sincos2d", "map", dict(classifier="map", position_embedding="sincos2d")),
        ("learn", "map", dict(classifier="map")),
        ("sincos2d", "tok", dict(position_embedding="sincos2d")),
    ],
)
def test_big_vision_checkpoint_loads_and_computes_big_visions_forward_pass(tmp_path, posemb, pool, kwargs):
    """A file in big_vision's layout, written with NumPy, loads into the model built with the same
    options (and the tanh GELU) and gives big_vision's outputs within 1e-5; save_npz then load is exact."""
    params = big_vision_checkpoint(3, posemb=posemb, pool=pool)
    model = small_vit(activation="gelu_tanh", **kwargs)
    assert keras_vit.load_pretrained(model, write_npz(params, tmp_path / "bv.npz")) == []
    images = random_images((3, 16, 16, 3))
    expected = numpy_big_vision_forward(params, images, numpy_vit.gelu_tanh)
    got = model.predict(images, verbose=0)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert np.ptp(expected, axis=0).max() > 0.1

    keras_vit.save_npz(model, str(tmp_path / "ours.npz"))
    saved = checkpoints.read_npz(str(tmp_path / "ours.npz"))
    assert ("Transformer/posembed_input/pos_embedding" in saved) == (posemb == "learn")
    assert ("MAPHead_0/MultiHeadDotProductAttention_0/key/kernel" in saved) == (pool == "map")
    again = small_vit(activation="gelu_tanh", **kwargs)
    keras_vit.load_pretrained(again, str(tmp_path / "ours.npz"))
    for key, value in weights_of(model).items():
        np.testing.assert_array_equal(weights_of(again)[key], value, err_msg=key)
    np.testing.assert_array_equal(again.predict(images, verbose=0), got)


def test_big_vision_map_head_names_and_shapes_round_trip(tmp_path):
    """save_npz writes the MAP head under big_vision's names and shapes; reading them back is exact."""
    params = big_vision_checkpoint(4)
    model = small_vit(classifier="map", position_embedding="sincos2d")
    keras_vit.load_pretrained(model, write_npz(params, tmp_path / "bv.npz"))
    keras_vit.save_npz(model, str(tmp_path / "ours.npz"))
    saved = checkpoints.read_npz(str(tmp_path / "ours.npz"))
    expected = checkpoints.canonicalize(params)
    assert saved.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(saved[key], expected[key], err_msg=key)


@pytest.mark.parametrize(
    "file, model, pattern",
    [
        (
            dict(posemb="sincos2d"),
            dict(classifier="map"),
            r"no key 'Transformer/posembed_input/pos_embedding'.*position_embedding='sincos2d'",
        ),
        (
            dict(posemb="learn"),
            dict(classifier="map", position_embedding="sincos2d"),
            r"learned position embeddings.*pos_embedding'\], which the model lacks.*position_embedding='learned'",
        ),
        (dict(pool="map"), dict(classifier="gap", position_embedding="sincos2d"), r"MAP head.*classifier='map'"),
        (
            dict(pool="gap"),
            dict(classifier="map", position_embedding="sincos2d"),
            r"no key 'MAPHead_0/probe'.*classifier='token' or 'gap'",
        ),
    ],
)
def test_big_vision_options_that_do_not_match_the_model_are_named(tmp_path, file, model, pattern):
    assert_load_fails_unchanged(write_npz(big_vision_checkpoint(5, **file), tmp_path / "bv.npz"), pattern, model=model)
