"""timm's ViT weights (.safetensors and .npz state dicts): names, round trips, resampling, parity with timm."""

import json
import pathlib
import subprocess

import numpy as np
import pytest

import keras_vit
from keras_vit import checkpoints
from keras_vit.checkpoints import timm as timm_weights
from keras_vit.testing import random_images, randomize_weights
from tests.builders import assert_load_fails_unchanged, small_vit, timm_python, weights_of

# The keys and shapes of timm's VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=2,
# num_heads=4, mlp_ratio=2, num_classes=5).state_dict() (the small model's size), as timm 1.0 names them
# (timm/models/vision_transformer.py).
TIMM_BLOCK = {
    **{f"{norm}.{param}": (16,) for norm in ("norm1", "norm2") for param in ("weight", "bias")},
    **{f"{linear}.weight": (out, inputs) for linear, out, inputs in [("attn.qkv", 48, 16), ("attn.proj", 16, 16)]},
    **{f"{linear}.weight": (out, inputs) for linear, out, inputs in [("mlp.fc1", 32, 16), ("mlp.fc2", 16, 32)]},
    **{
        f"{linear}.bias": (out,)
        for linear, out in [("attn.qkv", 48), ("attn.proj", 16), ("mlp.fc1", 32), ("mlp.fc2", 16)]
    },
}
TIMM_KEYS = {
    "cls_token": (1, 1, 16),
    "pos_embed": (1, 17, 16),
    "patch_embed.proj.weight": (16, 3, 4, 4),
    "patch_embed.proj.bias": (16,),
    **{f"blocks.{i}.{key}": shape for i in range(2) for key, shape in TIMM_BLOCK.items()},
    "norm.weight": (16,),
    "norm.bias": (16,),
    "head.weight": (5, 16),
    "head.bias": (5,),
}

# build_vit options and the timm VisionTransformer arguments of the same architecture.
CASES = {
    "token": ({}, {}),
    "no_embed_class": ({}, {"no_embed_class": True}),
    "gap_fc_norm": (dict(classifier="gap", pooled_norm=True), {"class_token": False, "global_pool": "avg"}),
    "pre_norm": (dict(pre_norm=True), {"pre_norm": True}),
    "map_tanh": (
        dict(classifier="map", activation="gelu_tanh"),
        {"class_token": False, "global_pool": "map", "act_layer": "gelu_tanh"},
    ),
    # The ViT family's options, in the combinations timm's models use them.
    "deit3": (dict(layer_scale=1e-6), {"init_values": 1e-6, "no_embed_class": True}),
    "registers": (dict(num_registers=4), {"reg_tokens": 4}),  # position rows for the registers, folded
    "dinov2_registers": (
        dict(layer_scale=1e-5, num_registers=4), {"init_values": 1e-5, "reg_tokens": 4, "no_embed_class": True}
    ),
    "registers_gap": (
        dict(num_registers=2, classifier="gap", pooled_norm=True),
        {"reg_tokens": 2, "class_token": False, "global_pool": "avg", "no_embed_class": True},
    ),
    "quick_gelu": (dict(activation="quick_gelu", pre_norm=True), {"act_layer": "quick_gelu", "pre_norm": True}),
    "no_qkv_bias": (dict(qkv_bias=False), {"qkv_bias": False}),
    "distilled": (dict(distillation="head"), {"distilled": True}),  # timm's VisionTransformerDistilled
    # AIMv2's layout: RMSNorm everywhere (the patch embeddings too), SwiGLU, no biases but the patch embedding's.
    "aimv2": (
        dict(norm="rms", patch_norm=True, mlp="swiglu", qkv_bias=False, classifier="gap"),
        {"class_token": False, "fc_norm": False, "global_pool": "avg", "qkv_bias": False, "proj_bias": False,
         "act_layer": "silu", "norm_layer": "rmsnorm", "embed_norm_layer": "RmsNorm", "mlp_layer": "SwiGLU"},
    ),
    # BEiT-3's and EVA's pooling: a class token beside a mean that leaves it out, with fc_norm.
    "unpooled_class_token": (dict(classifier="gap", class_token=True, pooled_norm=True), {"global_pool": "avg"}),
    # BEiT-3's: norms inside the attention and the MLP, a class token beside the mean, fc_norm.
    "beit3": (
        dict(sub_norms=True, classifier="gap", class_token=True, pooled_norm=True),
        {"scale_attn_norm": True, "scale_mlp_norm": True, "global_pool": "avg"},
    ),
    # timm's ParallelThingsBlock (the 18x2 models): two attentions, then two MLPs, each with layer scale.
    "parallel": (dict(parallel=2, layer_scale=1e-5), {"block_fn": "ParallelThingsBlock", "init_values": 1e-5}),
    # DINOv2 giant's: layer scale and timm's packed SwiGLU (one fc1 of twice the width).
    "swiglu_packed": (
        dict(mlp="swiglu", layer_scale=1e-5),
        {"mlp_layer": "SwiGLUPacked", "act_layer": "silu", "mlp_ratio": 8, "init_values": 1e-5},
    ),
}


def test_timm_names_and_shapes():
    model = randomize_weights(small_vit())
    state_dict = timm_weights.to_timm(checkpoints.model_checkpoint(model))
    assert {key: value.shape for key, value in state_dict.items()} == TIMM_KEYS
    # The layouts: torch Linear (out, in), conv (out, in, kh, kw), q, k, v rows in that order.
    block = model.get_layer("encoderblock_1")
    qkv = block.attention.qkv_kernel.numpy()
    np.testing.assert_array_equal(state_dict["blocks.1.attn.qkv.weight"][16:32], qkv[:, 1].T)
    np.testing.assert_array_equal(state_dict["blocks.1.mlp.fc1.weight"], block.mlp_dense_1.kernel.numpy().T)
    kernel = model.get_layer("patch_encoder").kernel.numpy()
    np.testing.assert_array_equal(state_dict["patch_embed.proj.weight"][5, 2], kernel[:, :, 2, 5])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_save_timm_then_load_is_exact(tmp_path, name, suffix):
    kwargs = CASES[name][0]
    model = randomize_weights(small_vit(**kwargs), seed=1)
    path = str(tmp_path / f"model{suffix}")
    keras_vit.save_timm(model, path)
    loaded = small_vit(**kwargs)
    assert keras_vit.load_pretrained(loaded, path) == []
    expected = weights_of(model)
    assert weights_of(loaded).keys() == expected.keys()
    for key, value in weights_of(loaded).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
    state_dict = checkpoints.read_checkpoint(path)
    again = timm_weights.to_timm(timm_weights.from_timm(state_dict, 4)[0])
    assert again.keys() == state_dict.keys()
    for key in state_dict:
        np.testing.assert_array_equal(again[key], state_dict[key], err_msg=key)


def test_a_distillation_token_with_registers_saves_and_loads_exactly(tmp_path):
    """Both tokens before the registers: timm's position rows (class, distillation, zero rows for the registers,
    patches) written and read back to the same weights."""
    model = randomize_weights(small_vit(distillation="token", num_registers=2), seed=6)
    keras_vit.save_timm(model, str(tmp_path / "model.safetensors"))
    assert checkpoints.read_checkpoint(str(tmp_path / "model.safetensors"))["pos_embed"].shape == (1, 2 + 2 + 16, 16)
    loaded = small_vit(distillation="token", num_registers=2)
    assert keras_vit.load_pretrained(loaded, str(tmp_path / "model.safetensors")) == []
    for key, value in weights_of(loaded).items():
        np.testing.assert_array_equal(value, weights_of(model)[key], err_msg=key)


def test_split_query_key_value_and_no_embed_class_layouts(tmp_path):
    """`attn.q`, `attn.k`, `attn.v` instead of the fused `attn.qkv`, and a `pos_embed` without the
    class token's row (timm's no_embed_class) load to the same model (the class token with a zero
    position)."""
    model = randomize_weights(small_vit(), seed=2)
    encoder = model.get_layer("patch_encoder")
    posemb = encoder.position_embedding.numpy()
    posemb[:, 0] = 0.0
    encoder.position_embedding.assign(posemb)
    state_dict = timm_weights.to_timm(checkpoints.model_checkpoint(model))
    state_dict["pos_embed"] = state_dict["pos_embed"][:, 1:]
    for i in range(2):
        for kind in ("weight", "bias"):
            fused = state_dict.pop(f"blocks.{i}.attn.qkv.{kind}")
            for name, part in zip("qkv", np.split(fused, 3)):
                state_dict[f"blocks.{i}.attn.{name}.{kind}"] = part
    checkpoints.write_safetensors(state_dict, str(tmp_path / "split.safetensors"))
    loaded = small_vit()
    keras_vit.load_pretrained(loaded, str(tmp_path / "split.safetensors"))
    for key, value in weights_of(model).items():
        np.testing.assert_array_equal(weights_of(loaded)[key], value, err_msg=key)


def write_bfloat16_safetensors(arrays, path):
    """A .safetensors file of bfloat16 arrays written by hand from the format's description: an
    8-byte little-endian header size, a JSON header of dtypes, shapes and byte offsets, the data."""
    header, blobs, offset = {}, [], 0
    for key, value in arrays.items():
        bits = (np.asarray(value, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[key] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [offset, offset + len(bits)]}
        blobs.append(bits)
        offset += len(bits)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_bfloat16_files_are_widened_to_float32(tmp_path):
    model = randomize_weights(small_vit(), seed=3)
    state_dict = timm_weights.to_timm(checkpoints.model_checkpoint(model))
    rounded = {k: (v.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32) for k, v in state_dict.items()}
    write_bfloat16_safetensors(state_dict, tmp_path / "bf16.safetensors")
    read = checkpoints.read_checkpoint(str(tmp_path / "bf16.safetensors"))
    assert read.keys() == rounded.keys()
    for key in rounded:
        assert read[key].dtype == np.float32
        np.testing.assert_array_equal(read[key], rounded[key], err_msg=key)
    loaded = small_vit()
    keras_vit.load_pretrained(loaded, str(tmp_path / "bf16.safetensors"))
    np.testing.assert_allclose(
        loaded.get_layer("head").kernel.numpy(), model.get_layer("head").kernel.numpy(), rtol=1e-2
    )


def test_through_tf_gfile(tmp_path):
    model = randomize_weights(small_vit(), seed=4)
    keras_vit.save_timm(model, "ram://timm/model.safetensors")
    loaded = small_vit()
    keras_vit.load_pretrained(loaded, "ram://timm/model.safetensors")
    np.testing.assert_array_equal(weights_of(loaded)["head/kernel"], weights_of(model)["head/kernel"])


# === Bad input: clear errors in timm's names, model unchanged ===


def assert_fails_unchanged(state_dict, tmp_path, pattern, **model_kwargs):
    checkpoints.write_safetensors(state_dict, str(tmp_path / "bad.safetensors"))
    assert_load_fails_unchanged(str(tmp_path / "bad.safetensors"), pattern, model=model_kwargs)


@pytest.fixture
def state_dict():
    return timm_weights.to_timm(checkpoints.model_checkpoint(randomize_weights(small_vit(), seed=6)))


def test_missing_key_is_named_in_timms_names(state_dict, tmp_path):
    del state_dict["blocks.1.mlp.fc2.weight"]
    assert_fails_unchanged(
        state_dict, tmp_path, r"no key 'blocks.1.mlp.fc2.weight'; closest keys present: \['blocks.1.mlp"
    )


def test_unsupported_timm_parts_are_named(state_dict, tmp_path):
    state_dict["blocks.0.attn.q_norm.weight"] = np.ones(4, "float32")
    state_dict["blocks.0.in_proj.weight"] = np.ones((80, 16), "float32")
    assert_fails_unchanged(
        state_dict, tmp_path,
        r"no place for.*'blocks.0.attn.q_norm.weight', 'blocks.0.in_proj.weight'.*parallel blocks with fused "
        r"projections.*query-key normalisation",
    )


@pytest.mark.parametrize("part", ["layer_scale", "registers", "no_qkv_bias"])
def test_a_file_and_a_model_that_differ_in_an_option_name_it(state_dict, tmp_path, part):
    """A file with layer scale or registers, or without query/key/value biases, into a model built otherwise
    (and the other way round): the option to build with, named, and nothing loaded."""
    option, built, pattern = {
        "layer_scale": ({"blocks.0.ls1.gamma": (16,), "blocks.0.ls2.gamma": (16,), "blocks.1.ls1.gamma": (16,),
                         "blocks.1.ls2.gamma": (16,)}, dict(layer_scale=1e-5), "layer_scale"),
        "registers": ({"reg_token": (1, 2, 16)}, dict(num_registers=2), "num_registers"),
        "no_qkv_bias": ({}, dict(qkv_bias=False), "qkv_bias"),
    }[part]  # fmt: skip
    with_option = dict(state_dict)
    with_option.update({key: np.full(shape, 0.5, "float32") for key, shape in option.items()})
    if part == "no_qkv_bias":
        with_option = {k: v for k, v in with_option.items() if not k.endswith("attn.qkv.bias")}
    if part == "no_qkv_bias":  # The option removes a part: the file lacks what the default model has.
        assert_fails_unchanged(with_option, tmp_path, r"has no key 'blocks.0.attn.qkv.bias'.*qkv_bias=False")
        assert_fails_unchanged(state_dict, tmp_path, r"biases: \['blocks.0.attn.qkv.bias'.*qkv_bias=True", **built)
    else:
        assert_fails_unchanged(with_option, tmp_path, rf"which the model lacks. Build it with {pattern}=")
        assert_fails_unchanged(state_dict, tmp_path, rf"has no key .*Build it with {pattern}=", **built)


def test_wrong_shapes_are_named(state_dict, tmp_path):
    state_dict["blocks.0.attn.qkv.weight"] = np.zeros((47, 16), "float32")
    assert_fails_unchanged(
        state_dict, tmp_path, r"'blocks.0.attn.qkv.weight' has shape \(47, 16\); expected \(3 x heads"
    )
    state_dict["blocks.0.attn.qkv.weight"] = np.zeros((48, 12), "float32")
    assert_fails_unchanged(state_dict, tmp_path, r"'encoderblock_0/attention/qkv_kernel'.*\(12, 3, 16\).*\(16, 3, 16\)")


def test_options_the_file_and_the_model_disagree_on_are_named(state_dict, tmp_path):
    assert_fails_unchanged(state_dict, tmp_path, r"no key 'norm_pre.weight'.*pre_norm=False", pre_norm=True)
    state_dict["fc_norm.weight"] = state_dict.pop("norm.weight")
    state_dict["fc_norm.bias"] = state_dict.pop("norm.bias")
    assert_fails_unchanged(state_dict, tmp_path, r"no key 'norm.weight'.*before the pooling.*pooled_norm=True")
    assert_fails_unchanged(
        state_dict,
        tmp_path,
        r"no key 'attn_pool.latent'.*classifier='token' or 'gap'",
        classifier="map",
        pooled_norm=True,
    )
    state_dict["pos_embed"] = state_dict["pos_embed"][:, :, :8]
    assert_fails_unchanged(
        state_dict, tmp_path, r"'patch_encoder/position_embedding'.*\(1, 17, 8\).*\(1, 17, 16\)", pooled_norm=True
    )


def test_norm_pre_files_without_a_patch_bias_get_a_zero_bias(tmp_path):
    """timm builds the patch embedding without a bias where it has norm_pre (CLIP's layout)."""
    model = randomize_weights(small_vit(pre_norm=True), seed=7)
    state_dict = timm_weights.to_timm(checkpoints.model_checkpoint(model))
    del state_dict["patch_embed.proj.bias"]
    checkpoints.write_safetensors(state_dict, str(tmp_path / "clip.safetensors"))
    loaded = randomize_weights(small_vit(pre_norm=True), seed=8)
    notes = keras_vit.load_pretrained(loaded, str(tmp_path / "clip.safetensors"))
    assert any("no bias" in note for note in notes)
    np.testing.assert_array_equal(loaded.get_layer("patch_encoder").bias.numpy(), 0.0)
    np.testing.assert_array_equal(weights_of(loaded)["pre_norm/gamma"], weights_of(model)["pre_norm/gamma"])


def test_not_a_checkpoint_names_both_formats(tmp_path):
    (tmp_path / "text.safetensors").write_text("not a checkpoint at all")
    with pytest.raises(checkpoints.CheckpointError, match="not an .npz checkpoint.*nor a .safetensors file"):
        keras_vit.load_pretrained(small_vit(), str(tmp_path / "text.safetensors"))
    model = randomize_weights(small_vit())
    keras_vit.save_timm(model, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoints.CheckpointError, match="truncated or corrupt"):
        keras_vit.load_pretrained(small_vit(), str(tmp_path / "cut.safetensors"))


# === Resampling as timm does: PyTorch's bicubic with antialias ===


def pillow_bicubic(grid, new_grid):
    """Pillow's bicubic resize of each channel of a float grid (mode "F"): the resampling PyTorch's
    antialiased bicubic reproduces (a = -0.5, support stretched when shrinking, weights normalised)."""
    from PIL import Image

    channels = [
        np.asarray(Image.fromarray(grid[..., c].astype(np.float32), mode="F").resize(new_grid[::-1], Image.BICUBIC))
        for c in range(grid.shape[-1])
    ]
    return np.stack(channels, axis=-1)


@pytest.mark.parametrize(
    "old_grid, new_grid", [((4, 4), (6, 6)), ((4, 4), (2, 3)), ((7, 5), (3, 9)), ((14, 14), (24, 24))]
)
def test_bicubic_antialias_is_pillows_bicubic(old_grid, new_grid):
    rng = np.random.default_rng(0)
    grid = rng.normal(size=(*old_grid, 3))
    posemb = np.concatenate([np.full((1, 1, 3), 7.0), grid.reshape(1, -1, 3)], axis=1)
    out = keras_vit.resample_position_embeddings(
        posemb, new_grid, "bicubic_antialias", old_grid=old_grid, num_prefix_tokens=1
    )
    np.testing.assert_array_equal(out[:, 0], posemb[:, 0])
    np.testing.assert_allclose(out[0, 1:].reshape(*new_grid, 3), pillow_bicubic(grid, new_grid), atol=1e-5)
    constant = np.full((1, old_grid[0] * old_grid[1], 2), 0.5)
    np.testing.assert_allclose(
        keras_vit.resample_position_embeddings(constant, new_grid, "bicubic_antialias", old_grid=old_grid), 0.5
    )


# === Parity with timm itself ===

# Run with a Python that has timm (PyTorch and TensorFlow in one process have crashed on this
# machine): builds each case's timm model with random weights, saves its state dict with
# safetensors, and writes its logits at 16 px and, loaded through timm's own checkpoint_filter_fn
# (which resamples pos_embed), at the other sizes. Its models have timm's default MLP width, 4 x 16
# (TIMM_MLP_DIM), or the case's own mlp_ratio.
TIMM_MLP_DIM = 64
TIMM_SIDE = r"""
import json, sys
import numpy as np, torch
import timm.layers
from safetensors.torch import save_file
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

torch.set_num_threads(1)
out, cases = sys.argv[1], json.loads(sys.argv[2])
images = dict(np.load(out + "/images.npz"))
outputs = {}
for name, (kwargs, sizes) in cases.items():
    model_class = VisionTransformerDistilled if kwargs.pop("distilled", False) else VisionTransformer
    for key in ("mlp_layer", "embed_norm_layer"):  # timm.layers classes, by name.
        if key in kwargs:
            kwargs[key] = getattr(timm.layers, kwargs[key])
    if "block_fn" in kwargs:  # A block class of vision_transformer.py, by name.
        kwargs["block_fn"] = getattr(timm.models.vision_transformer, kwargs["block_fn"])
    make = lambda size: model_class(
        img_size=size, patch_size=4, embed_dim=16, depth=2, num_heads=4, num_classes=5, **kwargs
    ).eval()
    model = make(16)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            module, _, kind = key.rpartition(".")
            norm_scale = "norm" in module.rpartition(".")[2] and kind == "weight"
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2 + norm_scale)
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state_dict, f"{out}/{name}.safetensors")
    for height, width in sizes:
        resized = model if (height, width) == (16, 16) else make((height, width))
        if resized is not model:
            resized.load_state_dict(checkpoint_filter_fn(state_dict, resized))
        x = torch.from_numpy(images[f"{height}x{width}"]).permute(0, 3, 1, 2) / 127.5 - 1.0
        with torch.no_grad():
            outputs[f"{name}/{height}x{width}"] = resized(x).numpy()
np.savez(out + "/outputs.npz", **outputs)
"""

SIZES = {
    "token": [(16, 16), (24, 24), (8, 12)],
    "no_embed_class": [(16, 16), (24, 16)],
    "map_tanh": [(16, 16), (24, 24)],
    "registers": [(16, 16), (24, 16)],
    "dinov2_registers": [(16, 16), (28, 28)],
    "distilled": [(16, 16), (24, 20)],
    "parallel": [(16, 16), (24, 24)],
}


@pytest.fixture(scope="module")
def timm_reference(tmp_path_factory):
    python = timm_python()
    out = tmp_path_factory.mktemp("timm")
    sizes = {(h, w) for name in CASES for h, w in SIZES.get(name, [(16, 16)])}
    np.savez(out / "images.npz", **{f"{h}x{w}": random_images((2, h, w, 3), seed=h * w) for h, w in sizes})
    cases = {name: (timm_kwargs, SIZES.get(name, [(16, 16)])) for name, (_, timm_kwargs) in CASES.items()}
    result = subprocess.run(
        [python, "-c", TIMM_SIDE, str(out), json.dumps(cases)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, dict(np.load(out / "outputs.npz"))


@pytest.mark.parametrize("name", list(CASES))
def test_timm_files_give_timms_outputs_at_every_size(timm_reference, name):
    """timm's own model and safetensors file: the logits here equal timm's within 1e-5, at the
    file's size and at other sizes (rectangular, up and down), where timm's checkpoint_filter_fn
    resamples the position embeddings and load_pretrained resamples them with bicubic_antialias."""
    out, outputs = timm_reference
    images = dict(np.load(out / "images.npz"))
    for height, width in SIZES.get(name, [(16, 16)]):
        model = small_vit(image_size=(height, width), mlp_dim=TIMM_MLP_DIM, **CASES[name][0])
        notes = keras_vit.load_pretrained(model, str(out / f"{name}.safetensors"))
        assert ((height, width) != (16, 16)) == any("bicubic_antialias" in note for note in notes)
        expected = outputs[f"{name}/{height}x{width}"]
        got = model.predict(images[f"{height}x{width}"], verbose=0)
        # Measured: within 1e-6 at every size; bicubic without antialias is 6e-3 off at 24 px.
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5, err_msg=f"{name} at {height}x{width}")
        assert np.ptp(expected, axis=0).max() > 0.1


def test_the_timm_table_opens_the_family_the_library_builds_and_names_what_it_refuses(tmp_path):
    """The rows of timm's ViT architectures: those whose parts the library builds open (DINOv2 with and without
    registers and its giant, DeiT III, distilled DeiT, AIMv2, EVA, quick-GELU CLIP, MIIL among them), the count
    docs/checkpoints.md states; a refused one is refused by from_pretrained naming its parts, before any array
    is read."""
    from keras_vit.checkpoints.readers import timm_refusals
    from keras_vit.checkpoints.timm_architectures import TIMM_ARCHITECTURES

    opens = {name for name, row in TIMM_ARCHITECTURES.items() if not timm_refusals(row)}
    assert {"vit_base_patch14_dinov2", "vit_large_patch14_reg4_dinov2", "deit3_base_patch16_224",
            "vit_base_patch16_clip_quickgelu_224", "vit_base_patch16_224_miil", "vit_base_patch16_224"} <= opens
    # At least 95% of timm's ViT and DeiT architectures open.
    assert len(opens) >= 0.95 * len(TIMM_ARCHITECTURES), (len(opens), len(TIMM_ARCHITECTURES))
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "checkpoints.md").read_text()
    refused = len(TIMM_ARCHITECTURES) - len(opens)
    assert f"Of the {len(TIMM_ARCHITECTURES)} architectures" in docs
    assert f"{len(opens)} open; the {refused} left" in docs
    assert {"vit_giant_patch14_reg4_dinov2", "aimv2_large_patch14_224", "deit_base_distilled_patch16_224",
            "eva_large_patch14_196", "beit3_base_patch16_224", "vit_small_patch16_18x2_224"} <= opens
    assert timm_refusals(TIMM_ARCHITECTURES["vit_base_patch16_rpn_224"]) == ["post-norm blocks"]
    folder = tmp_path / "parallel"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architecture": "vit_pwee_patch16_reg1_gap_256"}))
    checkpoints.write_safetensors({"cls_token": np.zeros((1, 1, 16), "float32")}, str(folder / "model.safetensors"))
    with pytest.raises(Exception, match="vit_pwee_patch16_reg1_gap_256' has parallel blocks with fused projections"):
        keras_vit.from_pretrained(folder)


# === FlexiViT's patch resize ===

FLEXIVIT_SIDE = r"""
import sys
import numpy as np, torch
from timm.layers import resample_patch_embed

kernel = np.load(sys.argv[1])  # (P, P, C, D): ours
torch_kernel = torch.from_numpy(kernel.transpose(3, 2, 0, 1).copy())  # (D, C, P, P): timm's
out = {}
for size in (3, 4, 7, 10):
    for mode, antialias in (("bicubic", True), ("bilinear", False)):
        resized = resample_patch_embed(torch_kernel, [size, size], interpolation=mode, antialias=antialias)
        out[f"{size}/{mode}{'_antialias' if antialias else ''}"] = resized.numpy().transpose(2, 3, 1, 0)
np.savez(sys.argv[2], **out)
"""


def test_flexivit_patch_resize_is_timms(tmp_path):
    """`resize_patch_kernel` against timm's own `resample_patch_embed` (the same pseudo-inverse, with PyTorch's
    resize) from 5 px patches to 3, 4, 7 and 10, bicubic with antialias (timm's default) and bilinear."""
    python = timm_python()
    kernel = np.random.default_rng(3).normal(size=(5, 5, 3, 6)).astype(np.float32)
    np.save(tmp_path / "kernel.npy", kernel)
    result = subprocess.run([python, "-c", FLEXIVIT_SIDE, str(tmp_path / "kernel.npy"), str(tmp_path / "out.npz")],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for key, expected in np.load(tmp_path / "out.npz").items():
        size, interpolation = key.split("/")
        got = checkpoints.resize_patch_kernel(kernel, (int(size), int(size)), interpolation)
        np.testing.assert_allclose(got, expected, atol=1e-4, err_msg=key)  # float32 pinv in timm
