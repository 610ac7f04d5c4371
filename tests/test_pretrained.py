"""`keras_vit.from_pretrained`: folders in timm's and transformers' hub layouts written here by hand (NumPy arrays
under the documented key names, configs with the documented fields), the original .npz, the hub's cache; the
architecture, preprocessing and labels read from them; any image size. Parity with timm and transformers
themselves: tests/test_pretrained_parity.py."""

import json
import os

import keras
import numpy as np
import pytest
from safetensors.numpy import save_file

import keras_vit
from keras_vit import checkpoints
from keras_vit.checkpoints.resample import interpolation_matrix
from keras_vit.layers.embedding import antialiased_bicubic_weights
from keras_vit.pretrained import PretrainedError
from keras_vit.testing import random_images, randomize_weights
from tests import numpy_vit
from tests.builders import (
    CLASSES,
    HEADS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    LAYERS,
    MLP,
    PATCH,
    SIDE,
    D,
    hand_written_state_dict,
    serve_all,
    timm_folder,
    transformers_numpy_params,
)
from tests.conftest import run_command_line


def transformers_folder(path, preprocessor=True, **config):
    """A folder as `ViTForImageClassification.save_pretrained` and its image processor write it."""
    path.mkdir(parents=True, exist_ok=True)
    state = hand_written_state_dict()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": D,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": MLP, "hidden_act": "gelu",
        "layer_norm_eps": 1e-12, "image_size": SIDE, "patch_size": PATCH, "num_channels": 3, "qkv_bias": True,
        "id2label": {str(i): f"label {i}" for i in range(CLASSES)},
        "label2id": {f"label {i}": i for i in range(CLASSES)},
        **config,
    }
    (path / "config.json").write_text(json.dumps(config))
    if preprocessor:  # DeiT's image processor: squash to 256 x 256 (here 28), crop 224 (here 24), bicubic.
        (path / "preprocessor_config.json").write_text(json.dumps({
            "do_resize": True, "size": {"height": 28, "width": 28}, "resample": 3, "do_center_crop": True,
            "crop_size": {"height": SIDE, "width": SIDE}, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD),
        }))
    return state


# === The layouts ===


def test_a_timm_folder_alone_gives_the_numpy_forward_pass_with_its_mean_std_and_labels(tmp_path):
    """DeiT's layout and statistics; the heads (3) from the architecture's row of the table, not the config."""
    state = timm_folder(tmp_path / "deit")
    model = keras_vit.from_pretrained(tmp_path / "deit")
    assert model.input_shape == (None, SIDE, SIDE, 3) and model.output_shape == (None, CLASSES)
    assert model.get_layer("encoderblock_0").num_heads == HEADS
    images = random_images((3, SIDE, SIDE, 3), seed=4).astype(np.uint8)
    expected = numpy_vit.vit_forward(
        transformers_numpy_params(state), LAYERS, images, mean=IMAGENET_MEAN, std=IMAGENET_STD
    )
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-4)
    # The same arrays with [-1, 1] pixels give other logits: the statistics are used.
    assert np.abs(numpy_vit.vit_forward(transformers_numpy_params(state), LAYERS, images) - expected).max() > 0.05
    assert model.class_names == tuple(f"timm {i}" for i in range(CLASSES))
    assert model.preprocessing == keras_vit.Preprocessing(
        (SIDE, SIDE), (26, 26), keep_aspect_ratio=True, interpolation="bicubic", crop_offset="half_even",
        mean=IMAGENET_MEAN, std=IMAGENET_STD,
    )  # floor(24 / 0.9) = 26, as timm's transforms_imagenet_eval.


def test_a_transformers_folder_alone_gives_the_numpy_forward_pass_with_its_epsilon_and_processor(tmp_path):
    state = transformers_folder(tmp_path / "vit")
    model = keras_vit.from_pretrained(str(tmp_path / "vit"))
    images = random_images((3, SIDE, SIDE, 3), seed=5).astype(np.uint8)
    params = transformers_numpy_params(state)
    expected = numpy_vit.vit_forward(params, LAYERS, images, mean=IMAGENET_MEAN, std=IMAGENET_STD, eps=1e-12)
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-4)
    assert model.get_layer("encoder_norm").epsilon == 1e-12
    assert model.class_names == tuple(f"label {i}" for i in range(CLASSES))
    assert model.preprocessing == keras_vit.Preprocessing(
        (SIDE, SIDE), (28, 28), keep_aspect_ratio=False, interpolation="bicubic", crop_offset="floor",
        mean=IMAGENET_MEAN, std=IMAGENET_STD,
    )
    # Without a preprocessor config: transformers' ViTImageProcessor defaults (squash to the size, bilinear,
    # mean = std = 0.5); "LABEL_i" names are transformers' placeholders, not names.
    transformers_folder(tmp_path / "plain", preprocessor=False, hidden_act="gelu_pytorch_tanh",
                        id2label={str(i): f"LABEL_{i}" for i in range(CLASSES)})
    plain = keras_vit.from_pretrained(tmp_path / "plain")
    assert plain.class_names is None and plain.get_layer("encoderblock_1").activation == "gelu_tanh"
    assert plain.preprocessing == keras_vit.Preprocessing((SIDE, SIDE), (SIDE, SIDE), keep_aspect_ratio=False,
                                                          crop_offset="floor")
    expected = numpy_vit.vit_forward(params, LAYERS, images, eps=1e-12, activation=numpy_vit.gelu_tanh)
    np.testing.assert_allclose(plain.predict(images, verbose=0), expected, atol=1e-4)


@pytest.mark.parametrize("variant, options", [
    ("testing", {"classifier": "gap", "representation_size": 6, "num_heads": 2, "patch_size": 4}),
    ("testing", {"classifier": "token", "num_heads": 2, "patch_size": 4}),
    ("R+Ti/16", {"num_heads": 3, "patch_size": 4}),  # a hybrid (stride 4 x patch 4): its stem from conv_root
])
def test_an_original_npz_gives_its_architecture_from_the_shapes(tmp_path, variant, options):
    source = randomize_weights(keras_vit.build_vit(
        variant, image_size=(16, 16), num_classes=4, hidden_dim=12, mlp_dim=20, num_layers=3, activation="gelu_tanh",
        **options))
    checkpoints.save_npz(source, tmp_path / "ViT-custom.npz")
    model = keras_vit.from_pretrained(tmp_path / "ViT-custom.npz")
    assert model.name == "ViT_custom" and model.count_params() == source.count_params()
    blocks = [layer for layer in model.layers if layer.name.startswith("encoderblock_")]
    assert (len(blocks), blocks[0].num_heads, blocks[0].mlp_dim, blocks[0].activation) == (
        3, options["num_heads"], 20, "gelu_tanh")
    assert model.input_shape == (None, 16, 16, 3) and model.class_names is None
    for a, b in zip(source.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    images = random_images((2, 16, 16, 3), seed=6)
    np.testing.assert_array_equal(model.predict(images, verbose=0), source.predict(images, verbose=0))
    # The original code's evaluation: the image squashed to the model's size.
    assert model.preprocessing == keras_vit.Preprocessing((16, 16), (16, 16), keep_aspect_ratio=False)
    # A folder holding the one .npz reads the same.
    np.testing.assert_array_equal(keras_vit.from_pretrained(tmp_path).predict(images, verbose=0),
                                  source.predict(images, verbose=0))


def test_the_original_reader_returns_the_spec_the_arrays_describe(tmp_path):
    """Each layout's reader returns (spec, arrays): the spec is the source model's, but for what an .npz
    cannot hold (its preprocessing, names, initializer); a model built from it loads the arrays exactly."""
    from keras_vit.checkpoints import readers

    source = randomize_weights(keras_vit.build_vit(
        "testing", image_size=(16, 16), num_classes=4, num_heads=2, patch_size=4, activation="gelu_tanh",
        class_names=["a", "b", "c", "d"]))  # fmt: skip
    checkpoints.save_npz(source, tmp_path / "vit.npz")
    path = str(tmp_path / "vit.npz")
    spec, arrays = readers.READERS["file"](path, None, None, path)
    unchanged = {"preprocessing": source.spec.preprocessing, "class_names": ("a", "b", "c", "d"),
                 "head_kernel_initializer": source.spec.head_kernel_initializer}  # fmt: skip
    assert spec.replace(**unchanged) == source.spec
    assert spec.class_names is None and spec.image_size == (16, 16)
    model = keras_vit.ViT(spec)
    checkpoints.model_io.load_params(model, arrays)
    images = random_images((2, 16, 16, 3), seed=3)
    np.testing.assert_array_equal(model.predict(images, verbose=0), source.predict(images, verbose=0))
    bigger, _ = readers.READERS["file"](path, None, None, path, image_size=(24, 24))
    assert bigger == spec.replace(image_size=(24, 24), preprocessing=keras_vit.Preprocessing(
        (24, 24), (24, 24), keep_aspect_ratio=False))  # fmt: skip


# === What a user changes ===


def test_another_size_another_head_and_fine_tuning_options(tmp_path):
    timm_folder(tmp_path / "deit")
    static = keras_vit.from_pretrained(tmp_path / "deit")
    wide = keras_vit.from_pretrained(tmp_path / "deit", image_size=(32, 16), dropout_rate=0.1, name="wide")
    expected = keras_vit.set_image_size(static, (32, 16), interpolation="bicubic_antialias")
    images = random_images((2, 32, 16, 3), seed=7)
    np.testing.assert_allclose(wide.predict(images, verbose=0), expected.predict(images, verbose=0), atol=1e-5)
    assert wide.name == "wide" and wide.get_layer("embedding_dropout").rate == 0.1
    assert wide.preprocessing.image_size == (32, 16) and wide.preprocessing.resize_size == (35, 17)
    assert wide.class_names == static.class_names
    new_head = keras_vit.from_pretrained(tmp_path / "deit", num_classes=7)
    assert new_head.output_shape == (None, 7) and new_head.class_names is None
    np.testing.assert_array_equal(new_head.get_layer("head").kernel.numpy(), 0.0)
    named = keras_vit.from_pretrained(tmp_path / "deit", num_classes=2, class_names=["cat", "dog"])
    assert named.class_names == ("cat", "dog")
    backbone = keras_vit.from_pretrained(tmp_path / "deit", num_classes=None)
    assert backbone.output_shape == (None, D)
    square = random_images((2, SIDE, SIDE, 3), seed=8)
    np.testing.assert_allclose(backbone.predict(square, verbose=0),
                               keras_vit.replace_head(static, None).predict(square, verbose=0), atol=1e-6)
    with pytest.raises(ValueError, match=r"3 class names for a model with num_classes=5"):
        keras_vit.from_pretrained(tmp_path / "deit", class_names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"\['hidden_dim'\] cannot be set"):
        keras_vit.from_pretrained(tmp_path / "deit", hidden_dim=16)


def test_any_image_size_resamples_in_the_graph_as_timm(tmp_path):
    """image_size="dynamic": the file's own size gives the static model's logits; another one (rectangular, up
    and down) those of the weights resampled as timm resamples them (bicubic with antialias)."""
    timm_folder(tmp_path / "deit")
    static = keras_vit.from_pretrained(tmp_path / "deit")
    model = keras_vit.from_pretrained(tmp_path / "deit", image_size="dynamic")
    assert model.input_shape == (None, None, None, 3)
    for height, width in ((SIDE, SIDE), (40, 16), (8, 32)):
        images = random_images((2, height, width, 3), seed=height + width)
        reference = keras_vit.set_image_size(static, (height, width), interpolation="bicubic_antialias")
        np.testing.assert_allclose(model.predict(images, verbose=0), reference.predict(images, verbose=0),
                                   atol=1e-5, err_msg=f"{height}x{width}")
    with pytest.raises(ValueError, match=r"divide by the patch size \(8, 8\).*\(1, 20, 24, 3\)"):
        model(np.zeros((1, 20, 24, 3), np.float32))
    # Another base size keeps it taking any size, its weights now made for 40 x 16.
    rebased = keras_vit.set_image_size(model, (40, 16), interpolation="bicubic_antialias")
    assert rebased.input_shape == (None, None, None, 3)
    assert rebased.get_layer("patch_encoder").base_image_size == (40, 16)
    images = random_images((2, 40, 16, 3), seed=12)
    reference = keras_vit.set_image_size(static, (40, 16), interpolation="bicubic_antialias")
    np.testing.assert_allclose(rebased.predict(images, verbose=0), reference.predict(images, verbose=0), atol=1e-5)
    # The graph's resampling matrices are the NumPy ones (the derivation is in keras_vit.checkpoints.resample).
    for old, new in ((3, 5), (5, 3), (4, 4), (14, 24), (24, 7)):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(antialiased_bicubic_weights(old, new)),
                                   interpolation_matrix(old, new, "bicubic_antialias"), atol=1e-6)


# === Errors ===


def test_what_cannot_be_read_is_named_with_the_layouts_tried(tmp_path):
    with pytest.raises(PretrainedError, match=r"neither a file, a folder nor a Hugging Face hub id.*timm \(config"):
        keras_vit.from_pretrained(str(tmp_path / "missing.npz"))
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "pytorch_model.bin").write_bytes(b"pickle")
    (tmp_path / "torch" / "config.json").write_text("{}")
    with pytest.raises(PretrainedError, match=r"pytorch_model.bin.*not read \(use a model.safetensors\)"):
        keras_vit.from_pretrained(tmp_path / "torch")
    transformers_folder(tmp_path / "swin", model_type="swin")
    with pytest.raises(PretrainedError, match=r"transformers 'swin' model; the model types read are \['vit', 'deit'"):
        keras_vit.from_pretrained(tmp_path / "swin")
    timm_folder(tmp_path / "post_norm", architecture="vit_base_patch16_rpn_224")
    with pytest.raises(PretrainedError, match=r"'vit_base_patch16_rpn_224' has post-norm blocks, which this library"):
        keras_vit.from_pretrained(tmp_path / "post_norm")
    timm_folder(tmp_path / "relu", model_args={"act_layer": "relu"})
    with pytest.raises(PretrainedError, match=r"act_layer='relu'"):
        keras_vit.from_pretrained(tmp_path / "relu")
    # An architecture outside the table: its heads are asked for, then read.
    timm_folder(tmp_path / "own", architecture="my_vit")
    with pytest.raises(PretrainedError, match=r"heads is in no config \(timm architecture 'my_vit'\); pass num_heads="):
        keras_vit.from_pretrained(tmp_path / "own")
    assert keras_vit.from_pretrained(tmp_path / "own", num_heads=HEADS).get_layer("encoderblock_0").num_heads == HEADS
    timm_folder(tmp_path / "map", global_pool="map")
    with pytest.raises(PretrainedError, match=r"global_pool='map' with the arrays of a classifier='token' model"):
        keras_vit.from_pretrained(tmp_path / "map")
    (tmp_path / "bad").mkdir()
    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text("[1, 2]")
    with pytest.raises(PretrainedError, match=r"holds a JSON list; expected an object"):
        keras_vit.from_pretrained(tmp_path / "bad")


@pytest.mark.parametrize("layout", ["timm", "transformers"])
def test_sharded_weights_read_as_the_whole_file(tmp_path, layout):
    """A folder whose weights are sharded (`model.safetensors.index.json` and its shards, as transformers and timm
    save large models) gives the model the whole file gives; a shard that lacks an indexed array, or is not
    there, is named."""
    whole = tmp_path / "whole"
    (timm_folder if layout == "timm" else transformers_folder)(whole)
    arrays = checkpoints.read_safetensors((whole / "model.safetensors").read_bytes(), "whole")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in os.listdir(whole):
        if name != "model.safetensors":
            (sharded / name).write_bytes((whole / name).read_bytes())
    keys = sorted(arrays)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for shard, names in shards.items():
        save_file({k: arrays[k] for k in names}, str(sharded / shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: shard for shard, names in shards.items() for k in names}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    images = random_images((2, SIDE, SIDE, 3))
    expected = keras_vit.from_pretrained(whole).predict(images, verbose=0)
    np.testing.assert_array_equal(keras_vit.from_pretrained(sharded).predict(images, verbose=0), expected)
    index["weight_map"]["extra.weight"] = "model-00001-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(checkpoints.CheckpointError, match=r"does not hold what .* says: missing \['extra.weight'\]"):
        keras_vit.from_pretrained(sharded)
    index["weight_map"]["extra.weight"] = "model-00003-of-00003.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(checkpoints.CheckpointError, match=r"names the shard 'model-00003-of-00003.safetensors'"):
        keras_vit.from_pretrained(sharded)


@pytest.mark.parametrize("layout, field, value, says", [
    ("transformers", "hidden_size", 1_000_000, "a width of 12"),
    ("transformers", "num_hidden_layers", 10_000, "2 blocks"),
    ("transformers", "intermediate_size", 7, "an MLP width of"),
    ("transformers", "patch_size", 4, "patches of"),
    ("transformers", "image_size", 48, "position embeddings for"),
    ("transformers", "num_attention_heads", 5, "a width of 12, which that many heads do not divide"),
    ("timm", "embed_dim", 1_000_000, "a width of 12"),
    ("timm", "depth", 3, "2 blocks"),
    ("timm", "img_size", 40, "position embeddings for"),
    ("timm", "num_classes", 7, "a head of"),
])
def test_a_config_that_contradicts_its_arrays_is_refused_naming_the_field_and_both_values(tmp_path, layout, field,
                                                                                         value, says):
    if layout == "timm" and field == "num_classes":
        timm_folder(tmp_path / "f", num_classes=value)
    elif layout == "timm":
        timm_folder(tmp_path / "f", model_args={field: value})
    else:
        transformers_folder(tmp_path / "f", **{field: value})
    name = f"model_args.{field}" if layout == "timm" and field != "num_classes" else field
    with pytest.raises(PretrainedError, match=rf"config.json says {name}={value}, the arrays hold {says}"):
        keras_vit.from_pretrained(tmp_path / "f")


def test_a_keras_file_is_loaded_by_keras_and_any_other_model_is_refused_by_name(tmp_path):
    """A `.keras` file of a keras_vit.ViT: Keras' own loading in safe mode, the same model (and with a new head
    or size, from its weights); another Keras model, or a .keras file under another name, named for what it is."""
    crop = keras_vit.Preprocessing.center_crop(16, 0.875)
    model = randomize_weights(keras_vit.build_vit("testing", image_size=16, num_classes=3, hidden_dim=16, num_layers=1,
                                                  num_heads=2, mlp_dim=32, patch_size=4, layer_scale=1e-5,
                                                  preprocessing=crop))  # fmt: skip
    model.save(tmp_path / "vit.keras")
    images = random_images((2, 16, 16, 3))
    loaded = keras_vit.from_pretrained(tmp_path / "vit.keras")
    np.testing.assert_array_equal(loaded.predict(images, verbose=0), model.predict(images, verbose=0))
    larger = keras_vit.from_pretrained(tmp_path / "vit.keras", image_size=24, num_classes=5)
    assert larger.output_shape == (None, 5) and larger.input_shape == (None, 24, 24, 3)
    assert larger.preprocessing == model.spec.preprocessing.at_size((24, 24))
    np.testing.assert_array_equal(larger.get_layer("encoderblock_0").mlp_scale.numpy(),
                                  model.get_layer("encoderblock_0").mlp_scale.numpy())  # fmt: skip
    (tmp_path / "renamed.npz").write_bytes((tmp_path / "vit.keras").read_bytes())  # A zip, as an .npz is.
    assert isinstance(keras_vit.from_pretrained(tmp_path / "renamed.npz"), keras_vit.ViT)
    model.quantize("int8")
    model.save(tmp_path / "int8.keras")
    assert keras_vit.from_pretrained(tmp_path / "int8.keras").get_layer("head").quantization_mode == "int8"
    with pytest.raises(PretrainedError, match="holds a quantized model"):
        keras_vit.from_pretrained(tmp_path / "int8.keras", num_classes=4)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    other.save(tmp_path / "other.keras")
    with pytest.raises(PretrainedError, match=r"holding a 'Sequential', not a keras_vit.ViT; load it with keras"):
        keras_vit.from_pretrained(tmp_path / "other.keras")


def test_hub_ids_are_read_from_huggingface_hubs_cache_offline(tmp_path, monkeypatch):
    """The hub's own code path: a cache laid out as huggingface_hub lays it out, HF_HUB_OFFLINE set."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "cache"
    for repo in ("google/vit-small", "timm/deit_tiny_patch16_224.fb_in1k"):
        storage = cache / ("models--" + repo.replace("/", "--"))
        (storage / "refs").mkdir(parents=True)
        (storage / "refs" / "main").write_text("0123abcd")
        if repo.startswith("google"):
            transformers_folder(storage / "snapshots" / "0123abcd")
        else:
            timm_folder(storage / "snapshots" / "0123abcd")
    images = random_images((2, SIDE, SIDE, 3), seed=8)
    google = keras_vit.from_pretrained("google/vit-small", cache_dir=str(cache))
    assert google.class_names[0] == "label 0" and google.name == "vit_small"
    timm = keras_vit.from_pretrained("deit_tiny_patch16_224.fb_in1k", cache_dir=str(cache))
    local = keras_vit.from_pretrained(cache / "models--timm--deit_tiny_patch16_224.fb_in1k" / "snapshots" / "0123abcd")
    np.testing.assert_array_equal(timm.predict(images, verbose=0), local.predict(images, verbose=0))
    with pytest.raises(PretrainedError, match=r"Could not get 'google/vit-large' from the Hugging Face hub or its local"
                                              r" cache.*Layouts read"):
        keras_vit.from_pretrained("hf-hub:google/vit-large", cache_dir=str(cache))


# === Preprocessing ===


def test_preprocessing_resizes_and_crops_as_torchvision_and_transformers_place_them():
    """A coordinate image resized with "nearest": the crop's first row and column say where the crop began,
    which must be where torchvision's Resize(int) + CenterCrop (round((H - h) / 2), ties to even) and
    transformers' center_crop ((H - h) // 2) begin it."""
    import tensorflow as tf

    rows, cols = np.meshgrid(np.arange(75), np.arange(50), indexing="ij")
    image = tf.constant(np.stack([rows, cols, rows * 0], -1).astype(np.uint8))
    timm = keras_vit.Preprocessing.center_crop(24, 0.9, interpolation="nearest")
    assert timm.resize_size == (26, 26) and keras_vit.Preprocessing.center_crop(224, 0.875).resize_size == (256, 256)
    out = timm(image).numpy()
    # The shorter side (50) becomes 26, the longer int(26 * 75 / 50) = 39; the crop starts at round(15 / 2) = 8
    # rows (ties to even) and round(2 / 2) = 1 column.
    assert out.shape == (24, 24, 3)
    nearest_rows = np.floor((np.arange(39) + 0.5) * 75 / 39).astype(int)
    nearest_cols = np.floor((np.arange(26) + 0.5) * 50 / 26).astype(int)
    np.testing.assert_array_equal(out[:, 0, 0], nearest_rows[8:32])
    np.testing.assert_array_equal(out[0, :, 1], nearest_cols[1:25])
    squash = keras_vit.Preprocessing((24, 24), (29, 27), keep_aspect_ratio=False, interpolation="nearest",
                                     crop_offset="floor")
    out = squash(image).numpy()
    np.testing.assert_array_equal(out[:, 0, 0], np.floor((np.arange(29) + 0.5) * 75 / 29).astype(int)[2:26])
    np.testing.assert_array_equal(out[0, :, 1], np.floor((np.arange(27) + 0.5) * 50 / 27).astype(int)[1:25])
    for bad, message in (({"interpolation": "hamming"}, "`interpolation` must be one of"),
                         ({"resize_size": (20, 30)}, "The resize must cover the crop"),
                         ({"crop_offset": "ceil"}, "`crop_offset` must be one of")):
        with pytest.raises(ValueError, match=message):
            keras_vit.Preprocessing(**{"image_size": 24, "resize_size": 26, **bad})


@pytest.mark.slow
def test_the_savedmodel_serves_with_the_weights_preprocessing_labels_and_any_size(tmp_path):
    """Served in a process that never imports keras_vit (tests/serving_check.py)."""
    import tensorflow as tf

    from keras_vit.data import decode_image
    from keras_vit.export import export_saved_model, export_tflite

    timm_folder(tmp_path / "deit")
    model = keras_vit.from_pretrained(tmp_path / "deit", image_size="dynamic")
    export_saved_model(model, tmp_path / "saved")
    # TFLite keeps the size the weights were made for.
    export_tflite(model, tmp_path / "model.tflite")
    photos = [tf.io.encode_png(random_images(shape, seed=9).astype(np.uint8)).numpy()
              for shape in ((41, 97, 3), (75, 50, 3))]
    other_size = random_images((2, 40, 16, 3), seed=10).astype(np.uint8)
    images = random_images((2, SIDE, SIDE, 3), seed=11).astype(np.uint8)
    served = serve_all({
        "saved_model": ("saved_model", tmp_path / "saved", {"images": other_size, "encoded": np.array(photos)}),
        "tflite": ("tflite", tmp_path / "model.tflite", {"images": images}),
    }, tmp_path / "serving")  # fmt: skip
    out = served["saved_model"]
    # Any size for raw pixels; the weights' resize and crop (timm's crop_pct, bicubic) for encoded photos.
    np.testing.assert_allclose(out["images_logits"], model.predict(other_size, verbose=0), atol=1e-5)
    prepared = np.stack([model.preprocessing(decode_image(photo)).numpy() for photo in photos])
    expected = model.predict(prepared, verbose=0)
    np.testing.assert_allclose(out["bytes_logits"], expected, atol=1e-5)
    np.testing.assert_array_equal(out["bytes_top_k_names"][:, 0].astype(str),
                                  np.array(model.class_names)[expected.argmax(-1)])
    np.testing.assert_allclose(served["tflite"]["logits"], model.predict(images, verbose=0), atol=1e-4)


@pytest.mark.slow
def test_the_export_job_exports_pretrained_weights_by_name(tmp_path):
    from types import SimpleNamespace

    from experiments import export as export_job

    transformers_folder(tmp_path / "vit")
    printed = run_command_line("experiments.export", f"--pretrained={tmp_path / 'vit'}", f"--out={tmp_path / 'sm'}")
    assert "top-1 agreement 100.0%" in printed and (tmp_path / "sm" / "saved_model.pb").exists()
    both = SimpleNamespace(model=SimpleNamespace(value="m.keras"), pretrained=SimpleNamespace(value="google/vit"))
    with pytest.raises(ValueError, match="Give one of --model and --pretrained"):
        export_job.main(both)
