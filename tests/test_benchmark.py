"""The benchmark command, run as a user runs it."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from keras_vit import compat
from keras_vit import data as vit_data
from keras_vit.testing import BATCHED_MATMULS, MATMULS, OTHER_PART, hlo_instructions, step_part
from tests.conftest import ROOT, run_module


@pytest.mark.slow
def test_benchmark_runs():
    args = ["--variant=testing", "--image_size=32", "--batch_size=2", "--repeats=2"]
    stdout = run_module("experiments.benchmark", "--mode=patch_projection", *args)
    assert "conv is" in stdout and "images/s" in stdout
    stdout = run_module("experiments.benchmark", "--mode=profile", *args)
    # The dense layers' matmuls with their bias, fused by TensorFlow's graph optimiser: oneDNN's op
    # where TensorFlow is built with it, else Eigen's.
    fused_matmul = "_MklNativeFusedMatMul" if compat.onednn_enabled() else "_FusedMatMul"
    assert re.search(rf"{fused_matmul}\s+[\d.]+ ms", stdout), stdout
    stdout = run_module("experiments.benchmark", "--mode=serving", *args)
    for name in ("saved_model", "tflite float32", "tflite float16", "tflite dynamic", "tflite int8"):
        assert name in stdout


@pytest.mark.slow
def test_train_profile_splits_the_compiled_step_into_matmuls_and_layers():
    """That it works and accounts for the step, not how fast."""
    stdout = run_module(
        "experiments.benchmark", "--mode=train_profile", "--variant=testing", "--image_size=32",
        "--batch_size=2", "--repeats=2",
    )  # fmt: skip
    row = r"^  (\S.*?)\s+[\d.]+ ms\s+([\d.]+)%$"
    shares = {name.strip(): float(share) for name, share in re.findall(row, stdout, re.M)}
    # Every part of the step had ops that the profiler timed, and the parts add up.
    attention = {BATCHED_MATMULS, "attention: softmax, scaling, q/k/v layout"}
    assert {MATMULS, "layer norms", "optimizer (AdamW update)"} | attention <= set(shares), stdout
    assert "blocks: GELU, biases, residual sums" in shares, stdout
    assert abs(sum(shares.values()) - 100) < 0.5, stdout
    # Logits and values, forward and backward: 3 x batch x layers x 4 x tokens^2 x width.
    config = keras_vit.parse_variant("testing")
    tokens = (32 // config.patch_size[0]) * (32 // config.patch_size[1]) + 1
    expected = 3 * 2 * config.num_layers * 4 * tokens**2 * config.hidden_dim
    attention = re.search(r"attention ([\d.e-]+) GFLOP at \d+ GFLOP/s", stdout)
    assert attention and float(attention.group(1)) == float(f"{expected / 1e9:.3g}"), stdout
    assert re.search(r"Matmuls: [\d.]+ GFLOP per step at \d+ GFLOP/s \(projections etc. [\d.e-]+ GFLOP", stdout)
    assert len(re.findall(r"^At the matmul (no XLA|XLA) peak", stdout, re.M)) == 2, stdout


def test_hlo_instructions_finds_matmuls_through_fusions():
    # One instruction per line, as XLA prints them.
    hlo = """HloModule step, entry_computation_layout={()->f32[2,2]{1,0}}

%fused_dot (p0: f32[2,2], p1: f32[2,2]) -> f32[2,2] {
  %p0 = f32[2,2]{1,0} parameter(0)
  %p1 = f32[2,2]{1,0} parameter(1)
  ROOT %d = f32[2,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer (q0: f32[2,2]) -> f32[2,2] {
  %q0 = f32[2,2]{1,0} parameter(0)
  ROOT %f = f32[2,2]{1,0} fusion(%q0, %q0), kind=kOutput, calls=%fused_dot
}

%fused_logits (s0: f32[3,2,2]) -> f32[3,2,2] {
  %s0 = f32[3,2,2]{2,1,0} parameter(0)
  ROOT %b = f32[3,2,2]{2,1,0} dot(%s0, %s0), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%fused_add (r0: f32[2,2]) -> f32[2,2] {
  %r0 = f32[2,2]{1,0} parameter(0)
  ROOT %a = f32[2,2]{1,0} add(%r0, %r0)
}

ENTRY %main (x: f32[2,2]) -> f32[2,2] {
  %x = f32[2,2]{1,0} parameter(0)
  %MatMul.3 = f32[2,2]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_type="MatMul" op_name="block/mlp/MatMul"}
  %add_fusion.1 = f32[2,2]{1,0} fusion(%MatMul.3), kind=kLoop, calls=%fused_add, metadata={op_type="AddV2" op_name="block/attention_norm/add"}
  %call.2 = f32[2,2]{1,0} call(%add_fusion.1), to_apply=%outer
  %y = f32[3,2,2]{2,1,0} broadcast(%x), dimensions={1,2}
  %logits = f32[3,2,2]{2,1,0} dot(%y, %y), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, metadata={op_type="BatchMatMulV2" op_name="block/attention/MatMul"}
  %batched_fusion = f32[3,2,2]{2,1,0} fusion(%logits), kind=kOutput, calls=%fused_logits
  %onednn = f32[2,2]{1,0} custom-call(%x, %x), custom_call_target="__onednn$matmul"
  %branch = f32[2,2]{1,0} conditional(%x), branch_computations={%fused_add, %fused_dot}
  %pair = (f32[2,2]{1,0}, f32[2,2]{1,0}) tuple(%call.2, %x)
  ROOT %out = f32[2,2]{1,0} get-tuple-element(%pair), index=0
}
"""
    instructions = hlo_instructions(hlo)
    matmul, batched = MATMULS, BATCHED_MATMULS
    assert instructions["MatMul.3"] == (matmul, "block/mlp/MatMul")
    assert instructions["add_fusion.1"] == ("", "block/attention_norm/add")
    assert instructions["call.2"][0] == instructions["f"][0] == matmul  # A dot two calls down.
    assert instructions["pair"][0] == instructions["out"][0] == ""
    assert instructions["logits"] == (batched, "block/attention/MatMul")
    assert instructions["batched_fusion"][0] == batched
    assert instructions["onednn"][0] == instructions["branch"][0] == matmul


def test_step_parts_count_a_layer_norms_matmuls_as_the_norm():
    assert step_part(MATMULS, "vit/encoderblock_0/attention_norm/MatMul") == "layer norms"
    assert step_part(MATMULS, "attention_norm_gradient_1/MatMul_1") == "layer norms"
    assert step_part(MATMULS, "gradient_tape/vit/encoderblock_0/MatMul/MatMul") == MATMULS
    assert step_part(BATCHED_MATMULS, "vit/encoderblock_0/attention/MatMul") == BATCHED_MATMULS
    assert step_part("", "vit/encoderblock_0/attention/Softmax").startswith("attention:")
    assert step_part("", "vit/encoderblock_0/mlp_norm/Rsqrt") == "layer norms"
    assert step_part("", "vit/encoderblock_0/add_1").startswith("blocks:")
    assert step_part("", "SparseSoftmaxCrossEntropyWithLogits") == OTHER_PART


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_throughput_benchmark_runs(mode):
    """The infer/train benchmark on the testing variant: that it works and reports, not how fast."""
    stdout = run_module(
        "experiments.benchmark", f"--mode={mode}", "--variant=testing", "--image_size=32",
        "--batch_size=2", "--repeats=2", "--steps=2",
    )  # fmt: skip
    flops = keras_vit.flops.count_flops("testing", image_size=32, training=mode == "train")
    assert f"Model FLOPs per image: {flops / 1e9:.6f} G" in stdout
    row = re.search(r"keras_vit \((?:no )?XLA\)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+1\.00x", stdout)
    assert row, stdout
    assert int(row[1].replace(",", "")) == keras_vit.build_vit("testing", image_size=32).count_params()
    images_per_second, gflops = float(row[2]), float(row[3])
    assert images_per_second > 0 and gflops == pytest.approx(images_per_second * flops / 1e9, rel=0.01, abs=0.06)
    peak = re.search(r"roofline (\d+) GFLOP/s", stdout)
    assert peak and int(peak[1]) > 0, stdout


def _fused_explicit_difference(stdout):
    found = re.search(r"Largest \|fused - explicit\| of the logits: (\S+) \(largest \|logit\| (\S+)\)", stdout)
    assert found and re.search(r"fused / explicit speed: [\d.]+x", stdout), stdout
    return float(found[1]), float(found[2])


@pytest.mark.slow
def test_attention_benchmark_runs():
    stdout = run_module(
        "experiments.benchmark", "--mode=attention", "--variant=testing", "--image_size=32",
        "--batch_size=2", "--repeats=2",
    )  # fmt: skip
    difference, largest = _fused_explicit_difference(stdout)
    assert largest > 0 and difference <= 1e-5 * max(1.0, largest)


# The JAX backend with TensorFlow hidden (as on a GPU machine without it): every
# `import tensorflow` fails.
WITHOUT_TENSORFLOW = """
import runpy, sys

class HideTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            raise ImportError(f"{name} is hidden")

sys.meta_path.insert(0, HideTensorFlow())
sys.argv = ["benchmark"] + sys.argv[1:]
try:
    runpy.run_module("experiments.benchmark", run_name="__main__")
finally:
    print("TensorFlow imported:", "tensorflow" in sys.modules)
"""


def run_benchmark_without_tensorflow(*args):
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TENSORFLOW, "--variant=testing", *args],
        cwd=ROOT, env=dict(os.environ, KERAS_BACKEND="jax"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["infer", "train", "attention"])
def test_benchmark_on_jax_without_tensorflow(mode):
    """The model, `predict`/`fit` and the benchmark run on JAX with no TensorFlow importable; the
    attention as `jax.nn.dot_product_attention` (JAX's own formulation) matches the explicit form."""
    result = run_benchmark_without_tensorflow(
        f"--mode={mode}", "--image_size=32", "--batch_size=2", "--repeats=2", "--steps=2"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "backend jax" in result.stdout and "TensorFlow imported: False" in result.stdout, result.stdout
    if mode == "attention":
        difference, largest = _fused_explicit_difference(result.stdout)
        assert largest > 0 and difference <= 1e-5 * max(1.0, largest)
        # The backward pass too: training-mode weight gradients of both forms.
        gradients = re.search(r"largest \|explicit\| of a weight: ([\d.e+-]+)", result.stdout)
        assert gradients and float(gradients.group(1)) <= 1e-4, result.stdout
    else:
        assert re.search(r"keras_vit \(XLA\)\s+[\d,]+\s+[\d.]+", result.stdout), result.stdout


def test_benchmark_modes_that_need_tensorflow_say_so():
    result = run_benchmark_without_tensorflow("--mode=profile")
    assert result.returncode != 0
    assert "--mode=profile needs TensorFlow; without it --mode=infer, train and attention run." in result.stderr


def test_benchmark_rejects_unknown_peers_and_names_the_missing_extra():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "experiments.benchmark", "--variant=testing", "--image_size=32", *args],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    result = run("--compare=vit_keras")
    assert result.returncode != 0
    assert "--compare takes a subset of ['keras_hub', 'timm', 'timm_compiled']" in result.stderr
    for peer, module, package in (
        ("keras_hub", "keras_hub", "keras-hub"), ("timm", "timm", "timm"), ("timm_compiled", "timm", "timm")
    ):  # fmt: skip
        if importlib.util.find_spec(module) is None:  # The test extra leaves the peers out.
            result = run(f"--compare={peer}")
            assert result.returncode != 0
            assert f"{package} is not installed" in result.stderr and '".[bench]"' in result.stderr


@pytest.mark.slow
def test_benchmark_measures_timm_eager_and_compiled_where_installed():
    """Both timm peers (the bench extra) run beside ours and get their rows and ratios."""
    pytest.importorskip("timm")
    stdout = run_module(
        "experiments.benchmark", "--mode=train", "--variant=testing", "--image_size=32", "--batch_size=4",
        "--steps=1", "--repeats=1", "--compare=timm,timm_compiled",
    )  # fmt: skip
    assert re.search(r"timm \(PyTorch eager, cpu\) +19,470 +[0-9.]+", stdout), stdout
    assert re.search(r"timm \(torch.compile, cpu\) +19,470 +[0-9.]+", stdout), stdout
    assert "keras_vit / timm: " in stdout and "keras_vit / timm_compiled: " in stdout
