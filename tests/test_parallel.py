"""keras_vit.distribute's meshes: the layout map, the distributions, and training on Keras' JAX backend over
a mesh of 8 (simulated) CPU devices, data parallel and tensor parallel by heads."""

import json
import os
import re

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import distribute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = [f"cpu:{i}" for i in range(8)]


def _mesh(shape=(2, 4), axis_names=("batch", "model")):
    return keras.distribution.DeviceMesh(shape, list(axis_names), DEVICES[: int(np.prod(shape))])


# === The layout map against the model's real variable paths ===


def test_the_layout_map_shards_every_attention_and_mlp_variable_and_replicates_the_rest():
    model = keras_vit.build_vit(
        "testing", image_size=16, num_layers=3, hidden_dim=32, num_heads=4, mlp_dim=64, representation_size=8
    )
    layout_map = distribute.get_layout_map(_mesh(), config=model)
    heads, head_dim = 4, 8
    sharded = {}
    for weight in model.weights:
        layout = layout_map[weight.path]
        if layout is None:
            continue
        assert len(layout.axes) == len(weight.shape), (weight.path, layout.axes, weight.shape)
        sharded[weight.path] = layout.axes
    # Written out from the model's structure, not from distribute.BLOCK_LAYOUTS.
    expected = {}
    for i in range(3):
        block = f"encoderblock_{i}"
        expected[f"{block}/attention/qkv_kernel"] = (None, None, "model")  # (D, 3, heads * head_dim)
        expected[f"{block}/attention/qkv_bias"] = (None, "model")
        expected[f"{block}/attention/output_kernel"] = ("model", None)  # (heads * head_dim, D)
        expected[f"{block}/mlp_dense_1/kernel"] = (None, "model")
        expected[f"{block}/mlp_dense_1/bias"] = ("model",)
        expected[f"{block}/mlp_dense_2/kernel"] = ("model", None)
    assert sharded == expected
    # Each of 4 devices holds whole heads: the sharded axis of the QKV kernel is heads x head_dim.
    qkv = model.get_layer("encoderblock_0").attention.qkv_kernel
    assert tuple(qkv.shape) == (32, 3, heads * head_dim)
    # The other variables (embeddings, norms, output biases, pre-logits, head) exist and are replicated.
    replicated = [w.path for w in model.weights if w.path not in sharded]
    assert {"patch_encoder/position_embedding", "encoderblock_2/mlp_norm/gamma", "pre_logits/kernel"} <= set(replicated)
    assert {"encoderblock_0/attention/output_bias", "encoderblock_0/mlp_dense_2/bias", "head/kernel"} <= set(replicated)
    # Another axis name, and the same keys under a prefix.
    other = distribute.get_layout_map(_mesh((2, 4), ("data", "tensor")), model_axis="tensor")
    assert other["encoderblock_7/attention/qkv_kernel"].axes == (None, None, "tensor")
    assert other["backbone/encoderblock_0/mlp_dense_2/kernel"].axes == ("tensor", None)
    assert other["encoderblock_0/mlp_dense_2/bias"] is None


def test_model_parallel_checks_that_heads_and_mlp_divide_over_the_model_axis():
    mesh = _mesh((2, 4))
    model = keras_vit.build_vit("testing", image_size=16, num_heads=4, hidden_dim=8, mlp_dim=8)
    for config in ("B/16", keras_vit.parse_variant("L/16"), model, model.get_layer("encoderblock_0")):
        distribute.check_model_parallel(config, mesh)
    with pytest.raises(ValueError, match=r"'model' of size 4 .*num_heads=6, mlp_dim=1536.*\[1, 2, 3, 6\]"):
        distribute.check_model_parallel("S/16", mesh)
    with pytest.raises(ValueError, match=r"num_heads=4, mlp_dim=6\b"):
        distribute.get_layout_map(mesh, config=keras_vit.parse_variant("testing", num_heads=4, hidden_dim=8, mlp_dim=6))
    with pytest.raises(ValueError, match=r"no axis 'model'.*axis_names=\['batch'\]"):
        distribute.get_layout_map(_mesh((8,), ("batch",)))
    with pytest.raises(ValueError, match=r"Expected a model from build_vit.*Received: 3"):
        distribute.check_model_parallel(3, mesh)


def test_make_distribution_errors_name_what_was_received():
    with pytest.raises(ValueError, match=r"one of \('data_parallel', 'model_parallel'\). Received: kind='pipeline'"):
        distribute.make_distribution("pipeline", devices=DEVICES)
    with pytest.raises(ValueError, match=r"product must be the device count, 8 .*mesh_shape=\(2, 3\) \(6 devices\)"):
        distribute.make_distribution("model_parallel", (2, 3), devices=DEVICES)
    with pytest.raises(ValueError, match=r"data_parallel must be \(devices,\) or \(devices, 1\).*mesh_shape=\(4, 2\)"):
        distribute.make_distribution("data_parallel", (4, 2), devices=DEVICES)
    with pytest.raises(ValueError, match=r"model_parallel must be \(batch, model\).*mesh_shape=8"):
        distribute.make_distribution("model_parallel", 8, devices=DEVICES)
    with pytest.raises(ValueError, match=r"'batch' of size 4 \(mesh shape \(4, 2\)\). Received: batch_size=10. Exp"):
        distribute.make_distribution("model_parallel", (4, 2), batch_size=10, devices=DEVICES)
    with pytest.raises(ValueError, match=r"num_heads=3"):
        distribute.make_distribution("model_parallel", (4, 2), config="Ti/16", devices=DEVICES)


# === Training on 8 devices (Keras' JAX backend, in the jax_without_tensorflow child) ===


IMAGE_SIZE, PATCH, HIDDEN, HEADS, MLP, LAYERS, CLASSES = 8, 2, 32, 4, 64, 2, 10
TOKENS = (IMAGE_SIZE // PATCH) ** 2 + 1
BATCH, STEPS, EPOCHS = 16, 3, 2
MESH = (2, 4)  # (batch, model)


def _tiny_vit():
    return keras_vit.build_vit(
        "testing", image_size=IMAGE_SIZE, patch_size=PATCH, hidden_dim=HIDDEN, num_heads=HEADS, mlp_dim=MLP,
        num_layers=LAYERS, num_classes=CLASSES, head_kernel_initializer="glorot_uniform",
    )  # fmt: skip


def _flat_qkv_attention_class():
    """The attention with the (hidden, 3 * hidden) kernel and (3 * hidden,) bias of earlier
    versions: q, k and v side by side, so a contiguous cut of the last axis is no cut by heads."""
    from keras_vit.layers import MultiHeadSelfAttention
    from keras_vit.layers.core import Dropout

    class FlatQKVAttention(MultiHeadSelfAttention):
        def build(self, input_shape):
            hidden = input_shape[-1]
            for name, shape in (("qkv_kernel", (hidden, 3 * hidden)), ("output_kernel", (hidden, hidden))):
                setattr(self, name, self.add_weight(name=name, shape=shape, initializer="glorot_uniform"))
            for name, shape in (("qkv_bias", (3 * hidden,)), ("output_bias", (hidden,))):
                setattr(self, name, self.add_weight(name=name, shape=shape, initializer="zeros"))
            self.attention_dropout = Dropout(0.0, name="attention_dropout")

    return FlatQKVAttention


def _compile(model):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss=loss)


def _axes(spec, rank):
    """A sharding's PartitionSpec as a list of `rank` mesh axis names or None."""
    return [*spec] + [None] * (rank - len(spec))


def train_on_eight_devices(out_dir):
    """The same tiny ViT, weights and batches trained with `fit` on one device, data
    parallel over 8 and model parallel over (2 batch, 4 model); writes the per-step losses,
    final weights, variable layouts and the compiled model-parallel step's HLO."""
    import pathlib

    import jax

    out_dir = pathlib.Path(out_dir)
    keras.utils.set_random_seed(0)
    initial = _tiny_vit().get_weights()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (BATCH * STEPS, IMAGE_SIZE, IMAGE_SIZE, 3)).astype("float32")
    labels = rng.integers(0, CLASSES, BATCH * STEPS)
    result = {"devices": len(jax.devices())}
    # Meshes over all 8 devices by default; for model parallel the largest model axis that fits.
    defaults = (("data_parallel", None), ("model_parallel", None), ("model_parallel", "S/16"))
    result["default_meshes"] = [
        list(distribute.make_distribution(kind, config=config).device_mesh.shape) for kind, config in defaults
    ]

    def compiled_step_hlo(model, distribution):
        """The optimized HLO of the training step as Keras' JAX trainer jits it
        (keras/src/backend/jax/trainer.py, `make_train_function`): `model.train_step` on
        (state, batch), the state donated and its shardings the output shardings. After `fit`
        JAX's compilation cache hands back the program `fit` ran."""
        state = tuple(
            [v.value for v in variables]
            for variables in (
                model.trainable_variables, model.non_trainable_variables,
                model.optimizer.variables, model.metrics_variables,
            )
        )  # fmt: skip
        shardings = jax.tree.map(lambda array: array.sharding, state)
        batch = tuple(
            keras.distribution.distribute_tensor(array[:BATCH], distribution.get_data_layout((BATCH, *array.shape[1:])))
            for array in (images, labels)
        )
        step = jax.jit(model.train_step, donate_argnums=0, out_shardings=(None, shardings))
        return step.lower(state, batch).compile().as_text()

    def train(name, distribution):
        keras.distribution.set_distribution(distribution)
        try:
            model = _tiny_vit()
            model.set_weights(initial)
            _compile(model)
            losses = []
            record = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda _, logs: losses.append(float(logs["loss"]))
            )
            model.fit(images, labels, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record])
            result[name] = {"losses": losses}
            np.savez(out_dir / f"{name}_weights.npz", *[np.asarray(w) for w in model.get_weights()])
            if distribution is not None:
                # Optimizer variables as "optimizer/<variable>_momentum", whichever SGD this is.
                result[name]["layouts"] = {
                    re.sub(r"^sgd(_\d+)?/", "optimizer/", v.path): _axes(v.value.sharding.spec, len(v.shape))
                    for v in model.weights + model.optimizer.variables
                }
                (out_dir / f"{name}.hlo").write_text(compiled_step_hlo(model, distribution))
        finally:
            keras.distribution.set_distribution(None)

    train("one_device", None)
    train("data_parallel", distribute.make_distribution("data_parallel", batch_size=BATCH))
    config = keras_vit.parse_variant("testing", hidden_dim=HIDDEN, num_heads=HEADS, mlp_dim=MLP, num_layers=LAYERS)
    train("model_parallel", distribute.make_distribution("model_parallel", MESH, batch_size=BATCH, config=config))

    # The same step for the flat layout sharded as it comes: the last axis cut in 4 contiguous
    # pieces, which are not heads (the first holds 24 of the 32 query columns).
    from keras_vit.layers import encoder

    flat = distribute.make_distribution("model_parallel", MESH)
    layout_map = keras.distribution.LayoutMap(flat.device_mesh)
    for name, axes in distribute.BLOCK_LAYOUTS.items():
        axes = {"attention/qkv_kernel": (None, "model"), "attention/qkv_bias": ("model",)}.get(name, axes)
        layout_map[distribute.block_pattern(name)] = axes
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    attention_class, encoder.MultiHeadSelfAttention = encoder.MultiHeadSelfAttention, _flat_qkv_attention_class()
    keras.distribution.set_distribution(distribution)
    try:
        model = _tiny_vit()
        assert tuple(model.get_layer("encoderblock_0").attention.qkv_kernel.shape) == (HIDDEN, 3 * HIDDEN)
        _compile(model)
        model.optimizer.build(model.trainable_variables)
        (out_dir / "flat_layout.hlo").write_text(compiled_step_hlo(model, distribution))
    finally:
        encoder.MultiHeadSelfAttention = attention_class
        keras.distribution.set_distribution(None)
    (out_dir / "result.json").write_text(json.dumps(result))


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo):
    """[(opcode, [array shapes], op_name)] of the collective instructions of an HLO module's text;
    an async pair counts once (its -start), a tuple-shaped one lists each array."""
    found = []
    pattern = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
    for line in hlo.splitlines():
        match = pattern.match(line)
        if match:
            arrays = re.findall(r"[a-z]+\d*\[([\d,]*)\]", match.group(1))
            shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in arrays]
            op_name = re.search(r'op_name="([^"]*)"', line)
            found.append((match.group(2), shapes, op_name.group(1) if op_name else ""))
    return found


def test_collectives_are_read_from_hlo_text():
    hlo = """
  %all-gather.1 = f32[4,17,96]{1,0,2} all-gather(%fusion), dimensions={2}, metadata={op_name="jit(step)/attention/dot"}
  %all-reduce.41 = (f32[], f32[3,8,32]{2,1,0}) all-reduce(%a, %b), channel_id=9, to_apply=%add
  ROOT %ars = f32[4,17,32]{2,1,0} all-reduce-start(%x), channel_id=2, to_apply=%add
  %ard = f32[4,17,32]{2,1,0} all-reduce-done(%ars)
  %dot = f32[4,17,96]{2,1,0} dot(%p, %q), lhs_contracting_dims={2}, rhs_contracting_dims={0}
"""
    assert collectives(hlo) == [
        ("all-gather", [(4, 17, 96)], "jit(step)/attention/dot"),
        ("all-reduce", [(), (3, 8, 32)], ""),
        ("all-reduce", [(4, 17, 32)], ""),
    ]


@pytest.mark.slow
@pytest.mark.environment("jax_without_tensorflow")
def test_data_and_model_parallel_training_match_one_device_and_shard_attention_by_heads(tmp_path):
    train_on_eight_devices(tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["devices"] == 8
    assert result["default_meshes"] == [[8], [1, 8], [4, 2]]  # S/16: 6 heads, so 2 on "model".

    # Same losses and weights: dropout is 0, so only the order of float32 sums differs (gradients
    # summed over 8 batch shards, projections over 4 model shards): a few ulps per step, under
    # 1e-5 relative after 6 SGD steps (measured: 0 for data parallel, ~1e-7 for model parallel).
    one = result["one_device"]["losses"]
    assert len(one) == STEPS * EPOCHS and one[-1] < one[0] - 0.1, one  # It trains.
    # Weights of order 0.1 to 1 after 6 steps: within 2e-5 (measured: under 5e-6).
    runs = ("one_device", "data_parallel", "model_parallel")
    weights = {name: np.load(tmp_path / f"{name}_weights.npz") for name in runs}
    for name in ("data_parallel", "model_parallel"):
        np.testing.assert_allclose(result[name]["losses"], one, rtol=1e-5, err_msg=name)
        for key in weights["one_device"].files:
            want = weights["one_device"][key]
            np.testing.assert_allclose(weights[name][key], want, rtol=0, atol=2e-5, err_msg=f"{name} {key}")

    # Every attention and MLP variable (and its momentum) laid out as the table says, the rest replicated.
    layouts = result["model_parallel"]["layouts"]
    wanted = {
        "attention/qkv_kernel": [None, None, "model"], "attention/qkv_bias": [None, "model"],
        "attention/output_kernel": ["model", None], "mlp_dense_1/kernel": [None, "model"],
        "mlp_dense_1/bias": ["model"], "mlp_dense_2/kernel": ["model", None],
    }  # fmt: skip
    sharded = {path: axes for path, axes in layouts.items() if any(axes)}
    expected = {}
    for i in range(LAYERS):
        for name, axes in wanted.items():
            expected[f"encoderblock_{i}/{name}"] = axes
            expected[f"optimizer/encoderblock_{i}_{name.replace('/', '_')}_momentum"] = axes
    assert sharded == expected, sorted(set(sharded) ^ set(expected))
    assert all(not any(axes) for axes in result["data_parallel"]["layouts"].values())

    # The compiled model-parallel step: no all-gather (or all-to-all) of the QKV activation,
    # batch_per_data_shard x tokens x 3 x hidden elements in whatever shape; and the all-reduces
    # of the row-parallel projections (attention output, MLP's second dense) of every block,
    # over (batch_per_data_shard, tokens, hidden).
    shard_batch = BATCH // MESH[0]
    qkv_elements = shard_batch * TOKENS * 3 * HIDDEN

    def gathers_of_qkv(found):
        gathers = [(op, shapes) for op, shapes, _ in found if op in ("all-gather", "all-to-all")]
        return [(op, shapes) for op, shapes in gathers if any(int(np.prod(s)) == qkv_elements for s in shapes)]

    good = collectives((tmp_path / "model_parallel.hlo").read_text())
    assert not gathers_of_qkv(good), gathers_of_qkv(good)
    assert not [c for c in good if c[0] in ("all-gather", "all-to-all")], good
    block_output = (shard_batch, TOKENS, HIDDEN)
    reduced = [name for op, shapes, name in good if op in ("all-reduce", "reduce-scatter") and block_output in shapes]
    for i in range(LAYERS):
        for projection in ("attention", "mlp_dense_2"):
            forward = rf"(?<!transpose\()jvp\(encoderblock_{i}\)/{projection}/"
            assert any(re.search(forward, name) for name in reduced), (i, projection, reduced)
    # Forward: 2 per block; backward: the input gradients of the 2 column-parallel projections.
    assert len(reduced) == 4 * LAYERS, reduced

    # The check can fail: the flat layout cut contiguously all-gathers the whole QKV activation.
    flat = collectives((tmp_path / "flat_layout.hlo").read_text())
    assert len(gathers_of_qkv(flat)) >= LAYERS, flat
