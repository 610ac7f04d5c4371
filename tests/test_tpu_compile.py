"""The training job's step compiled for Cloud TPU topologies by the TPU compiler (libtpu) on this CPU host, and
the compiled program read for what wastes a TPU.

Selected with `-m tpu_compile`; they run on Keras' JAX backend with `jax[tpu]` installed (.ci/run's third
environment) and skip elsewhere, with the reason. The model is small (4 blocks of width 256, 64 x 64 images)
so that each compile takes seconds, with every training feature the ImageNet config uses and the fine-tuning ones.
"""

import importlib.util
import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

# Before JAX loads libtpu: this module's compiles may run beside another process's (a batch search).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(
        os.environ.get("KERAS_BACKEND") != "jax", reason="compiles on Keras' JAX backend (KERAS_BACKEND=jax)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason='the TPU compiler is not installed: pip install "jax[tpu]"',
    ),
]

TOPOLOGY, BATCH = "v5e:2x2", 32


def small_job_config(**changes):
    """The ImageNet job's config (mixed bfloat16, AdamW on the kernels, MixUp) with a small model and the other
    training features on: CutMix, gradient accumulation, the moving average, layer decay and stochastic
    depth. (Dropout, which no TPU config uses, draws random bits for every activation: the compiler counts
    their hashing as FLOPs, about a tenth of this small model's.)"""
    from experiments.configs import imagenet_s16

    config = imagenet_s16.get_config()
    config.image_size = 64
    config.model.update(dict(variant="B/16", hidden_dim=256, num_layers=2, num_heads=4, mlp_dim=1024,
                             representation_size=256, stochastic_depth_rate=0.1))  # fmt: skip
    config.augment.cutmix_alpha = 1.0
    config.grad_accum_steps = 2
    config.ema_momentum = 0.999
    config.layer_decay = 0.75
    config.update(changes)
    return config


@pytest.fixture(scope="module")
def compiled_steps():
    """{"data": (row, step), "model": (row, step)}: the small job's training step on v5e:2x2, data parallel and
    split by heads over a (2, 2) mesh."""
    from experiments import tpu_compile

    config = small_job_config()
    return {
        layout: tpu_compile.compile_once(config, TOPOLOGY, BATCH, layout=layout, mesh_shape=mesh)
        for layout, mesh in (("data", None), ("model", ("2", "2")))
    }


def test_the_row_says_what_the_compiler_reported(compiled_steps):
    row, step = compiled_steps["data"]
    assert (row["topology"], row["chips"], row["chip_kind"], row["global_batch"]) == (TOPOLOGY, 4, "TPU v5 lite", 32)
    assert (row["precision"], row["layout"], row["mesh"]) == ("mixed_bfloat16", "data", {"batch": 4})
    memory = step.compiled.memory_analysis()
    assert row["bytes_per_chip"]["arguments"] == memory.argument_size_in_bytes > 0
    assert row["bytes_per_chip"]["temporaries"] == memory.temp_size_in_bytes > 0
    # The state is donated, as in fit: the new state is written over the old one.
    assert row["bytes_per_chip"]["aliased"] > 0.9 * row["bytes_per_chip"]["outputs"]
    assert row["hbm_bytes_per_chip"] == 16 * 2**30 and row["fits"]
    assert row["flops_per_chip"] == step.compiled.cost_analysis()["flops"]


def test_the_training_step_costs_three_forward_passes(compiled_steps):
    """FLOPs per chip within 5% of `keras_vit.flops`' count: 3 x the forward pass of a quarter of the batch.
    The rest (softmax, norms, GELU, the optimizer's update, the moving average, MixUp/CutMix) is what the
    analytic count leaves out."""
    from keras_vit.flops import count_flops

    row, _ = compiled_steps["data"]
    analytic = count_flops("B/16", image_size=64, num_classes=1000, classifier="gap", representation_size=256,
                           hidden_dim=256, num_layers=2, num_heads=4, mlp_dim=1024, training=True) * BATCH / 4
    assert row["analytic_flops_per_chip"] == analytic
    assert abs(row["recompute_overhead"]) <= 0.05, row["recompute_overhead"]


def test_matmuls_multiply_bfloat16_under_mixed_bfloat16(compiled_steps):
    """Every dot and convolution takes bfloat16 operands but two kinds, as docs/distributed.md says: the head
    (float32 by design: logits and the loss in float32) and the attention logits' gradient, where the compiler
    folds the gradient's cast to bfloat16 into the matmul (default precision: one bfloat16 pass)."""
    from keras_vit import aot

    _, step = compiled_steps["data"]
    found = aot.matmuls(step.hlo)
    assert len(found) >= 4 * 8  # Each block's 4 matmuls and 2 attention products, forward and backward.
    in_float32 = aot.float32_matmuls(step.hlo)
    unexplained = [m.op_name for m in in_float32 if "(head)" not in m.op_name and "BTNH,BSNH->BNTS" not in m.op_name]
    assert not unexplained
    assert any("(head)" in m.op_name for m in in_float32)
    # None at a higher precision than one bfloat16 pass (which would multiply in float32, 3 or 6 passes).
    assert not [m for m, _ in found if "operand_precision={high" in m.text]


def test_the_float32_check_finds_a_float32_matmul():
    import jax
    import jax.numpy as jnp

    from keras_vit import aot

    devices = aot.topology_devices(TOPOLOGY)
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=sharding)
    y = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=sharding)
    hlo = jax.jit(lambda a, b: a @ b.astype(jnp.float32)).lower(x, y).compile().as_text()
    assert len(aot.float32_matmuls(hlo)) == 1
    hlo = jax.jit(lambda a, b: a.astype(jnp.bfloat16) @ b).lower(x, y).compile().as_text()
    assert aot.float32_matmuls(hlo) == [] and len(aot.matmuls(hlo)) == 1


def test_nothing_in_the_step_talks_to_the_host(compiled_steps):
    from keras_vit import aot

    for layout in ("data", "model"):
        assert aot.host_transfers(compiled_steps[layout][1].hlo) == []
        assert compiled_steps[layout][0]["host_transfers"] == 0


def test_the_host_check_finds_a_callback():
    import jax
    import jax.numpy as jnp

    from keras_vit import aot

    devices = aot.topology_devices(TOPOLOGY)
    x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(devices[0]))

    def step(a):
        jax.debug.callback(print, a)
        return a * 2

    assert len(aot.host_transfers(jax.jit(step).lower(x).compile().as_text())) >= 1


def per_chip_bytes(spec):
    return int(np.prod(spec.sharding.shard_shape(spec.shape))) * np.dtype(spec.dtype).itemsize


def test_model_layout_shards_the_large_kernels(compiled_steps):
    """Split by heads over a model axis of 2, each chip holds half of every block's kernels and of their
    optimizer moments and moving averages (the embeddings, norms and head stay whole): the compiler's argument
    bytes are what those layouts give, and the blocks' share of them halves."""
    from keras_vit import distribute

    blocks = {}
    for layout in ("data", "model"):
        row, step = compiled_steps[layout]
        state, batch = step.arguments
        _, _, optimizer, _ = state
        # The compiler's bytes are those of the layouts, within the tiles' padding of the small arrays.
        expected = sum(per_chip_bytes(s) for s in keras.tree.flatten(step.arguments))
        assert row["bytes_per_chip"]["arguments"] == pytest.approx(expected, rel=0.01)
        sharded = [name.replace("/", "_") for name in distribute.BLOCK_LAYOUTS]
        names = [v.name for v in step.model.optimizer.variables]
        kernels = [s for s, name in zip(optimizer, names) if any(k in name for k in sharded)]
        assert len(kernels) == 2 * 6 * 3  # blocks x sharded variables x (2 moments + the moving average)
        blocks[layout] = sum(per_chip_bytes(s) for s in kernels)
    assert compiled_steps["model"][0]["mesh"] == {"batch": 2, "model": 2}
    assert blocks["data"] == 2 * blocks["model"]
    # The blocks' FLOPs are shared over the same 4 chips; what stays whole (patch embedding, norms, pre-logits,
    # head) is computed by both chips of the model axis, for their batch shard: a little more per chip.
    data, model = compiled_steps["data"][0]["flops_per_chip"], compiled_steps["model"][0]["flops_per_chip"]
    assert data < model < 1.15 * data


def test_attention_padding_is_measured_from_the_tiles(compiled_steps):
    """(batch, heads, 17, 64) and (batch, heads, 17, 17) arrays are stored in (8, 128) tiles: the padding the
    compiled program's layouts show is what the tiles' arithmetic gives."""
    from keras_vit import aot

    _, step = compiled_steps["data"]
    padding = aot.attention_padding(step.hlo)
    assert padding["ratio"] > 1.0
    for logical, padded in padding["shapes"].items():
        logical, padded = eval(logical), eval(padded)  # noqa: S307 (tuples of ints written by str())
        assert len(logical) == len(padded) and all(p >= n and (p == n or p % 8 == 0) for n, p in zip(logical, padded))
    instruction = aot.Instruction("x", "convolution", "bf16", (4, 12, 197, 64), "{2,3,1,0:T(8,128)(2,1)}", (), "", "")
    assert aot.padded_shape(instruction) == (4, 12, 256, 64 + 0)  # 197 minor: 256; 64 next: already 8's multiple


def test_a_v4_slice_compiles_the_serving_step():
    """One megacore device per chip on v4 (as JAX shows a v4 slice), and `predict`'s step in bfloat16 costs
    the forward pass."""
    from experiments import tpu_compile

    config = small_job_config(precision="mixed_bfloat16")
    row, step = tpu_compile.compile_once(config, "v4:2x2x1", BATCH, mode="serve")
    assert (row["chips"], row["chip_kind"], row["mode"]) == (4, "TPU v4", "serve")
    assert abs(row["recompute_overhead"]) <= 0.05, row["recompute_overhead"]
    assert row["float32_matmuls"] == 1  # The head's.
    assert row["host_transfers"] == 0 and row["fits"]


def test_a_step_too_large_says_by_how_much():
    from experiments import tpu_compile
    from keras_vit import aot

    config = small_job_config(grad_accum_steps=1, image_size=256)  # 256 tokens: 32 MiB per image per block
    message = r"needs [\d.]+ GiB per chip, [\d.]+ GiB more than the 15.75 GiB"  # v5e's 16 GiB, less the runtime's
    with pytest.raises(aot.DoesNotFitError, match=message) as raised:
        tpu_compile.compile_once(config, TOPOLOGY, 4 * 32768, mode="serve")
    assert raised.value.needed_bytes > raised.value.available_bytes


def test_fit_runs_one_executable_whatever_the_epoch_and_learning_rate():
    """`fit` over 3 epochs of a warm-up schedule traces and compiles the training step once: the epoch, the
    step and the learning rate are values in the state, not constants of the program."""
    import jax
    import keras

    from experiments import models

    config = small_job_config(grad_accum_steps=1, precision="float32", batch_size=8)
    config.model.update(dict(hidden_dim=32, num_layers=1, num_heads=2, mlp_dim=64, representation_size=32))
    config.image_size = 32
    keras.mixed_precision.set_global_policy("float32")
    model = models.build_model(config, 10)
    models.compile_model(model, config, models.make_optimizer(config, 12, 4, model=model))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (32, 32, 32, 3), dtype=np.uint8)
    y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 32)]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    finally:
        logger.removeHandler(handler)
    compiled = [r.getMessage() for r in records if "train_step" in r.getMessage() and "Compiling" in r.getMessage()]
    assert len(compiled) == 1, compiled
    assert int(model.optimizer.iterations.numpy()) == 12


def test_the_command_names_the_known_topologies_and_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.tpu_compile", "--topology=v5e:3x3", "--results_file="],
        cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, text=True, timeout=120,
        env={**os.environ, "KERAS_BACKEND": "jax"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "does not know the topology 'v5e:3x3'" in result.stderr and "v5e:2x2, v5e:2x4, v5e:4x4" in result.stderr
