"""The benchmark command, run as a user runs it, its results rows and the tables made of them."""

import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from absl import flags

import keras_vit
from experiments.benchmark import cli, peers, results, tables
from keras_vit import compat
from keras_vit.testing import BATCHED_MATMULS, MATMULS, OTHER_PART, hlo_instructions, step_part
from tests.conftest import ROOT, run_module

MODULES = ["experiments.benchmark"] + [
    f"experiments.benchmark.{name}"
    for name in (
        "cli", "timing", "throughput", "attention", "profiling", "serving", "peaks", "predict", "inputs", "results",
        "tables", "peers",
    )  # fmt: skip
]
TINY = ["--variant=testing", "--image_size=32", "--batch_size=2", "--repeats=2"]

# Runs several benchmark commands in one process (one Keras import, one TensorFlow start): the flags
# parsed as `python -m experiments.benchmark ARGS` parses them, then the same `main`. The runs come as
# JSON in argv[1]; each one's output starts with a line "=== ARGS".
RUNS = """
import json, sys
from absl import flags
from experiments.benchmark import cli

cli.define_flags()
for args in json.loads(sys.argv[1]):
    sys.argv = ["benchmark", *args]
    flags.FLAGS.unparse_flags()
    flags.FLAGS(sys.argv)
    print("=== " + " ".join(args), flush=True)
    cli.main(sys.argv)
"""
def run_benchmarks(runs):
    """{" ".join(args): its stdout} of each run of `runs` (lists of arguments), all in one fresh process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-c", RUNS, json.dumps(runs)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parts = re.split(r"^=== (.*)\n", result.stdout, flags=re.M)
    outputs = dict(zip(parts[1::2], parts[2::2]))
    assert list(outputs) == [" ".join(args) for args in runs], result.stdout[-3000:]
    return outputs, result.stdout


def seeded_results_file(path):
    """A results file that already holds a row (the first carried one of results/cpu.jsonl), without its
    final newline: the runs must append after it and keep it."""
    first = (ROOT / "results" / "cpu.jsonl").read_text().splitlines()[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(first)
    return path, json.loads(first)


# === Importing, flags, peers ===


def test_importing_the_benchmark_defines_no_flag_and_imports_no_keras():
    for module in MODULES:
        importlib.import_module(module)
    # No flag of absl's global registry comes from the benchmark (whichever modules this session imported).
    defined = {name: flags.FLAGS.find_module_defining_flag(name, "") for name in flags.FLAGS}
    assert not [name for name, module in defined.items() if module.startswith("experiments.benchmark")]
    names = cli.define_flags(flags.FlagValues())  # A registry of its own: the global one stays as it is.
    assert {"mode", "variant", "compare", "results_file", "timm_python"} <= set(names)
    # The package itself, as `python -m experiments.benchmark.tables` and the command line start.
    code = (
        "import json, sys, experiments.benchmark.cli, experiments.benchmark.tables\n"
        "print(json.dumps([*sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    imported = {name.split(".")[0] for name in json.loads(result.stdout)}
    assert "experiments" in imported and not imported & {"keras", "keras_vit", "tensorflow", "jax"}


def test_flag_choices_are_the_library_s():
    assert cli.JIT_COMPILE == keras_vit.training.JIT_COMPILE
    assert set(cli.MODE_FLAGS) == set(cli.MODES)
    names = set(cli.define_flags(flags.FlagValues()))
    assert all(set(config) <= names for config in cli.MODE_FLAGS.values())


@pytest.mark.parametrize("value", ["1,x", "0", "8,-1", ""])
def test_batch_lists_that_are_not_positive_integers_are_refused_naming_the_flag(value):
    values = flags.FlagValues()
    cli.define_flags(values)
    for name in ("serving_batches", "predict_batches"):
        with pytest.raises(flags.IllegalFlagValueError, match=rf"--{name}=.*positive integers separated by commas"):
            values([sys.argv[0], f"--{name}={value}"])
    values([sys.argv[0], "--serving_batches=1,8", "--predict_batches=32"])
    assert values.serving_batches == ["1", "8"] and values.predict_batches == ["32"]


@pytest.mark.environment("jax_without_tensorflow")
def test_benchmark_modes_that_need_tensorflow_say_so():
    for mode in cli.ANY_BACKEND_MODES:
        cli.check_tensorflow(mode)  # Nothing to say.
    with pytest.raises(SystemExit, match=r"--mode=profile needs TensorFlow; without it --mode=infer, train and "
                                         r"attention run\."):  # fmt: skip
        cli.check_tensorflow("profile")


def test_benchmark_rejects_unknown_peers_and_names_the_missing_extra():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.benchmark", "--variant=testing", "--compare=vit_keras"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--compare takes a subset of ['keras_hub', 'timm', 'timm_compiled']" in result.stderr
    for peer, (module, package) in peers.PEERS.items():
        if importlib.util.find_spec(module) is None:  # The test extra leaves the peers out.
            with pytest.raises(SystemExit, match=rf"{package} is not installed.*\"\.\[bench\]\""):
                peers.check_compare([peer])
    # timm in another interpreter (--timm_python) is that interpreter's to find.
    peers.check_compare(["timm", "timm_compiled"], timm_python="/another/python")


# === Results rows and tables ===


def test_append_row_keeps_the_rows_before_it(tmp_path):
    path, first = seeded_results_file(tmp_path / "results" / "cpu.jsonl")
    os.chmod(path, 0o664)
    second = {**first, "date": "2027-01-01", "figures": {**first["figures"], "ours": "keras_vit (XLA)"}}
    results.append_row(path, second)
    results.append_row(path, first)
    assert results.read_rows(path) == [first, second, first]
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o664)
    assert os.listdir(path.parent) == ["cpu.jsonl"]  # No temporary file left.
    path.write_text(path.read_text() + '{"schema": 1}\n')
    with pytest.raises(ValueError, match=r"cpu.jsonl:4: a row without \['date'"):
        results.read_rows(path)


def result_files():
    """The benchmark's results files (tpu_compile.jsonl holds compiles, not runs: tests/test_tpu_compile_results.py)."""
    return sorted(path for path in (ROOT / "results").glob("*.jsonl") if path.name != "tpu_compile.jsonl")


def test_results_files_hold_well_formed_consistent_rows():
    """Each row of results/: its fields, and its ratios and fractions of the peak agree with its figures."""
    assert {path.name for path in result_files()} >= {"cpu.jsonl", "gpu_h200.jsonl"}
    for path in result_files():
        rows = results.read_rows(path)
        assert rows, path
        for row in rows:
            assert row["schema"] == results.SCHEMA
            datetime.date.fromisoformat(row["date"][:10])
            assert re.fullmatch(r"[0-9a-f]{40}", row["commit"] or "0" * 40), row["commit"]
            assert row["command"].startswith("python -m experiments.benchmark --mode=" + row["mode"])
            assert "keras" in row["versions"] or "tensorflow" in row["versions"]
            assert row["device"]["machine"] and row["device"]["accelerator"] in ("cpu", "gpu", "tpu")
            assert set(row) <= set(results.FIELDS) | {"backend", "xla", "dirty", "stale", "note", "source"}
            if row["mode"] not in ("infer", "train"):
                continue
            figures = row["figures"]
            ours = figures["images_per_second"][figures["ours"]]
            for name, ratio in row["ratios"].items():
                if ratio["against"] in figures["images_per_second"]:
                    expected = ours / figures["images_per_second"][ratio["against"]]
                    assert ratio["ratio"] == pytest.approx(expected, abs=0.006), (path.name, name, row["config"])
            if "of_peak" in figures:
                config = row["config"]
                flops = keras_vit.flops.count_flops(
                    config["variant"], image_size=config["image_size"], training=row["mode"] == "train"
                )
                expected = ours * flops / figures["peak_flops_per_second"]
                assert figures["of_peak"][figures["ours"]] == pytest.approx(expected, rel=0.02), row["config"]


def test_tables_are_views_of_the_results_rows():
    """Every marked table of README.md and docs/performance.md is what its rows make it; every view is
    shown; `python -m experiments.benchmark.tables --check` agrees."""
    assert tables.stale_regions() == [], "run: python -m experiments.benchmark.tables"
    shown = {page: re.findall(r"<!-- results:([\w-]+) -->", (ROOT / page).read_text()) for page in tables.PAGES}
    assert set(shown["README.md"]) == {"gpu_h200", "cpu_amx"}
    assert set(sum(shown.values(), [])) == set(tables.VIEWS)
    assert tables.main(["--check"]) == 0


def test_a_table_that_disagrees_with_its_rows_is_found(tmp_path):
    changed = tmp_path / "results"
    shutil.copytree(ROOT / "results", changed)
    rows = (changed / "gpu_h200.jsonl").read_text().replace('"keras_vit (XLA)": 5067', '"keras_vit (XLA)": 5068')
    (changed / "gpu_h200.jsonl").write_text(rows)
    expected = {("README.md", "gpu_h200"), ("docs/performance.md", "gpu_h200")}
    assert set(tables.stale_regions(results=changed)) == expected


def test_tables_show_the_latest_row_of_a_measurement_and_what_is_stale():
    rows = [row for row in results.read_rows(ROOT / "results" / "gpu_h200.jsonl") if row["mode"] == "train"]
    old, newer = rows[0], json.loads(json.dumps(rows[0]))
    newer.update(date="2027-01-02T03:04:05+00:00", commit="f" * 40, dirty=True)
    del newer["stale"], newer["source"]
    newer["figures"]["images_per_second"]["keras_vit (XLA)"] = 2500
    text = tables.table([old, newer, rows[1]], "gpu_h200")
    lines = text.splitlines()
    assert lines[0].startswith("| measurement (224 px unless noted) | keras_vit images/s | keras-hub | timm (eager) |")
    assert "| MFU | measured |" in lines[0]
    assert len([line for line in lines if line.startswith("| B/16 training step (AdamW), batch 64,")]) == 1
    assert "| B/16 training step (AdamW), batch 64, mixed_bfloat16, XLA | 2,500 | 1,991 (XLA) |" in text
    assert "| 2027-01-02 [a] |" in text and "| 2026-11-30 [b, c] |" in text  # The S/16 row has a note.
    assert "- [a] 2027-01-02, commit fffffff with local changes; 1 x NVIDIA H200, driver 580.159.04;" in text
    assert re.search(r"- \[b\] 2026-11-30, commit d269e86; .*\*\*Stale\*\*: measured before the padded cuDNN", text)
    assert "- [c] float32: JAX ran our matmuls in TF32" in text


def test_the_input_table_shows_each_form_and_the_comparisons_of_the_last_input_row():
    row = {
        "mode": "input", "date": "2027-01-02T03:04:05+00:00", "commit": "a" * 40, "dirty": False,
        "config": {"image_size": 224, "batch_size": 64, "randaugment": ["2", "10"]},
        "device": {"accelerator": "cpu", "machine": "Some CPU", "cpu_cores": 2, "cpu_flags": ["avx2"]},
        "versions": {"tensorflow": "2.21.0", "tf-models-nightly": "2.21.0.dev1"},
        "ratios": {"model_garden": {"against": "model_garden", "ratio": 1.5}},
        "figures": {
            "ours": "keras_vit", "data": "8 photos", "cached": True, "load_average": [0.5, 1.25],
            "images_per_second": {"crop_flip": 400.0, "keras_vit": 300.0, "model_garden": 200.0},
            "images_per_second_per_core": {"crop_flip": 200.0, "keras_vit": 150.0, "model_garden": 100.0},
            "cpu_seconds_per_image": {"crop_flip": 0.004, "keras_vit": 0.005, "model_garden": 0.0075},
            "cores_per_1000_images_per_second": {"crop_flip": 4.0, "keras_vit": 5.0, "model_garden": 7.5},
            "busy_cores": {"crop_flip": 1.6, "keras_vit": 1.5, "model_garden": 1.5},
            "cpu_time_ratios": {"crop_flip": 0.8, "model_garden": 1.5},
            "randaugment_added_cost": 1 / 3, "randaugment_added_cpu_time": 0.25,
        },
    }
    older = json.loads(json.dumps(row))
    older["figures"]["images_per_second"]["keras_vit"] = 1.0
    text = tables.input_table([older, row])
    assert "| (b) + keras_vit's RandAugment(2, 10) | 300 | 150 | 5.00 | 5.0 |" in text
    assert "| (c) + TF Model Garden's RandAugment(2, 10) | 200 | 100 | 7.50 | 7.5 |" in text
    assert "keras_vit / Model Garden: 1.50x the images/s; Model Garden's CPU time per image / keras_vit's: 1.50x" in (
        text
    )
    assert "RandAugment adds 33.3% to the time of (a), 25.0% to its CPU time." in text
    assert "(load average 0.5 before, 1.2 after)" in text and "tf-models-nightly 2.21.0.dev1" in text
    assert tables.input_table([]) == "No results yet.\n"


# === The modes, run ===


EXTRA_FLAGS = {
    "infer": ["--steps=2"], "train": ["--steps=2"], "serving": ["--serving_batches=1,2", f"--threads={os.cpu_count()}"],
    "predict": ["--predict_batches=2,4", "--synthetic_images=6"],
}  # fmt: skip


@pytest.fixture(scope="module")
def tensorflow_runs(tmp_path_factory):
    """Every TensorFlow mode on the testing variant, one after the other in one process, each but
    train_profile appending its row to a results file that held one row: (outputs, rows, first row)."""
    path, first = seeded_results_file(tmp_path_factory.mktemp("results") / "cpu.jsonl")
    # train_profile first, with no row: it asks XLA to name its ops to the profiler, which XLA reads when it
    # first compiles.
    runs = [["--mode=train_profile", *TINY]] + [
        [f"--mode={mode}", *TINY, *EXTRA_FLAGS.get(mode, []), f"--results_file={path}"]
        for mode in ("infer", "train", "attention", "patch_projection", "profile", "serving", "peaks", "predict")
    ]
    outputs, _ = run_benchmarks(runs)
    return {args[0].removeprefix("--mode="): outputs[" ".join(args)] for args in runs}, results.read_rows(path), first


@pytest.mark.slow
def test_benchmark_runs(tensorflow_runs):
    outputs, _, _ = tensorflow_runs
    assert "conv is" in outputs["patch_projection"] and "images/s" in outputs["patch_projection"]
    # The dense layers' matmuls with their bias, fused by TensorFlow's graph optimiser: oneDNN's op
    # where TensorFlow is built with it, else Eigen's.
    fused_matmul = "_MklNativeFusedMatMul" if compat.onednn_enabled() else "_FusedMatMul"
    assert re.search(rf"{fused_matmul}\s+[\d.]+ ms", outputs["profile"]), outputs["profile"]
    serving = outputs["serving"]
    for batch in (1, 2):
        table = serving.split(f"batch {batch}:", 1)[1].split("batch", 1)[0]
        for name in ("saved_model", "saved_model bfloat16", "saved_model int8", "tflite float32", "tflite float16",
                     "tflite dynamic", "tflite int8"):
            # Each artefact's size, latency, ratio to the Keras model and share of its runtime's matmul peak.
            row = re.search(rf"^  {name} +[\d.]+ +[\d.]+ +[\d.]+x +([\d.]+)%$", table, re.MULTILINE)
            assert row and 0 < float(row[1]), (name, table)
    assert f"{os.cpu_count()} threads" in serving
    # ONNX Runtime's rows: our ONNX export, and timm's where timm is installed (else said to be left out).
    if importlib.util.find_spec("onnxruntime"):
        timm = importlib.util.find_spec("timm") is not None
        assert ("timm's ONNX export: timm " in serving) == timm
        assert ("timm is not installed here" in serving) != timm
        peers = ["onnxruntime"] + ["onnxruntime timm"] * timm
        for name in [f"{peer} {precision}" for peer in peers for precision in ("float32", "int8")]:
            assert re.search(rf"^  {name} +[\d.]+ +[\d.]+ +[\d.]+x +—$", serving, re.MULTILINE), (name, serving)
    # The prediction job over a folder of photos, each artefact at each batch size, and the decoding's own rate.
    predict = outputs["predict"]
    assert re.search(r"^  decoding alone \(read, decode, resize, crop; tf.data\): [\d.]+ images/s$", predict, re.M)
    assert re.search(r"^  loading \(once, not timed below\): saved_model [\d.]+ s, saved_model bfloat16 [\d.]+ s, "
                     r"saved_model int8 [\d.]+ s$", predict, re.M)  # fmt: skip
    names = ["keras (.keras)", "saved_model", "saved_model bfloat16", "saved_model int8"]
    names += ["onnxruntime float32", "onnxruntime int8"] if importlib.util.find_spec("onnxruntime") else []
    for batch in (2, 4):
        table = predict.split(f"batch {batch}:", 1)[1].split("batch", 1)[0]
        for name in names:
            assert re.search(rf"^  {re.escape(name)} +[\d.]+ images/s +[\d.]+x ", table, re.M), (name, table)
    peaks = outputs["peaks"]
    for runtime, precisions in (("tensorflow", ["float32", "bfloat16"] + ["int8"] * compat.onednn_enabled()),
                                ("tensorflow XLA", ["float32", "bfloat16", "int8"]),
                                ("litert", ["float32", "dynamic int8", "int8"])):  # fmt: skip
        for precision in precisions:
            # A rate per block matmul (qkv, attention output, the MLP's two), the peak, the ratio to float32's.
            assert re.search(rf"^  {runtime} +{precision} +(\d+ +){{5}}[\d.]+x$", peaks, re.MULTILINE), (
                runtime, precision, peaks)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_throughput_benchmark_runs(tensorflow_runs, mode):
    """The infer/train benchmark on the testing variant: that it works and reports, not how fast."""
    outputs, rows, _ = tensorflow_runs
    stdout = outputs[mode]
    flops = keras_vit.flops.count_flops("testing", image_size=32, training=mode == "train")
    assert f"Model FLOPs per image: {flops / 1e9:.6f} G" in stdout
    row = re.search(r"(keras_vit \((?:no )?XLA\))\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+1\.00x", stdout)
    assert row, stdout
    assert int(row[2].replace(",", "")) == keras_vit.build_vit("testing", image_size=32).count_params()
    images_per_second, gflops = float(row[3]), float(row[4])
    assert images_per_second > 0 and gflops == pytest.approx(images_per_second * flops / 1e9, rel=0.01, abs=0.06)
    peak = re.search(r"roofline (\d+) GFLOP/s", stdout)
    assert peak and int(peak[1]) > 0, stdout
    # Its results row holds the same figures.
    (result,) = [r for r in rows if r["mode"] == mode and r["figures"].get("model_flops_per_image")]
    figures = result["figures"]
    assert figures["ours"] == row[1] and result["xla"] == (row[1] == "keras_vit (XLA)")
    assert f"{figures['images_per_second'][row[1]]:.2f}" == row[3]
    assert f"{100 * figures['of_peak'][row[1]]:.1f}" == row[5]
    assert figures["params"][row[1]] == int(row[2].replace(",", ""))
    assert f"{figures['peak_flops_per_second'] / 1e9:.0f}" == peak[1]
    assert figures["model_flops_per_image"] == flops
    # The table made of it shows them.
    line = tables.table([result], "cpu").splitlines()[2]
    assert line.startswith(f"| testing {'training step (AdamW)' if mode == 'train' else 'inference'} at 32 px, batch 2")
    assert f"| {row[3]} |" in line and f"| {row[5]}% of {peak[1]} GFLOP/s |" in line


@pytest.mark.slow
def test_benchmark_appends_a_well_formed_row_per_run(tensorflow_runs):
    outputs, rows, first = tensorflow_runs
    assert rows[0] == first  # The row that was there, kept.
    assert [row["mode"] for row in rows[1:]] == [mode for mode in outputs if mode != "train_profile"]
    for row in rows[1:]:
        assert row["command"].startswith(f"python -m experiments.benchmark --mode={row['mode']} --variant=testing")
        assert row["config"]["variant"] == "testing" and row["config"]["repeats"] == 2
        # The checkout's commit then: HEAD now, or one before it.
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", row["commit"], "HEAD"], cwd=ROOT)
        assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]) and ancestor.returncode == 0, row["commit"]
        assert isinstance(row["dirty"], bool)
        assert row["backend"] == "tensorflow" and row["versions"]["keras"] == importlib.metadata.version("keras")
        assert row["device"]["accelerator"] == "cpu" and row["device"]["cpu_cores"] == os.cpu_count()
        assert row["device"]["onednn"] == compat.onednn_enabled()
        assert datetime.datetime.fromisoformat(row["date"]).tzinfo is not None
    printed = re.search(r"of the logits: (\S+)", outputs["attention"])[1]
    assert f"{rows[3]['figures']['max_abs_difference']:.3g}" == printed
    onnx = {"onnxruntime float32", "onnxruntime int8"} if importlib.util.find_spec("onnxruntime") else set()
    assert set(rows[6]["figures"]["bytes"]) == {"keras (.keras)", "saved_model", "saved_model bfloat16",
                                                "saved_model int8"} | onnx | {
        f"tflite {name}" for name in ("float32", "float16", "dynamic", "int8")
    }  # fmt: skip
    assert set(rows[6]["figures"]["seconds"]) == {"1", "2"} and rows[6]["config"]["serving_batches"] == ["1", "2"]
    # The peaks' row: a rate per runtime, precision and block matmul, and the CPU's features beside them.
    peaks = rows[7]["figures"]
    assert set(peaks["flops_per_second"]["litert"]["int8"]) == {"qkv", "attention output", "mlp in", "mlp out"}
    assert peaks["cpu_flags"] == results.cpu_flags() and rows[7]["config"]["batch_size"] == 2
    assert set(rows[8]["figures"]["images_per_second"]) == {"2", "4"}
    assert rows[8]["config"]["synthetic_images"] == 6 and rows[8]["figures"]["decode_images_per_second"] > 0


@pytest.mark.slow
def test_train_profile_splits_the_compiled_step_into_matmuls_and_layers(tensorflow_runs):
    """That it works and accounts for the step, not how fast."""
    stdout = tensorflow_runs[0]["train_profile"]
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


def _fused_explicit_difference(stdout):
    found = re.search(r"Largest \|fused - explicit\| of the logits: (\S+) \(largest \|logit\| (\S+)\)", stdout)
    assert found and re.search(r"fused / explicit speed: [\d.]+x", stdout), stdout
    return float(found[1]), float(found[2])


@pytest.mark.slow
def test_attention_benchmark_runs(tensorflow_runs):
    outputs, _, _ = tensorflow_runs
    difference, largest = _fused_explicit_difference(outputs["attention"])
    assert largest > 0 and difference <= 1e-5 * max(1.0, largest)


def run_benchmarks_here(runs):
    """RUNS's loop in this process (a child of tests/environments.py, whose absl registry is its own):
    ({" ".join(args): its stdout}, the whole stdout)."""
    import contextlib
    import io

    if "mode" not in flags.FLAGS:
        cli.define_flags()
    printed, argv = io.StringIO(), sys.argv
    try:
        with contextlib.redirect_stdout(printed):
            for args in runs:
                sys.argv = ["benchmark", *args]
                flags.FLAGS.unparse_flags()
                flags.FLAGS(sys.argv)
                print("=== " + " ".join(args), flush=True)
                cli.main(sys.argv)
    finally:
        sys.argv = argv
    parts = re.split(r"^=== (.*)\n", printed.getvalue(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2])), printed.getvalue()


@pytest.fixture(scope="module")
def jax_runs(tmp_path_factory):
    """infer, train and attention on JAX with TensorFlow hidden (the jax_without_tensorflow child), one after
    the other; attention appends its row to a results file: (outputs by mode, whole stdout, rows)."""
    path = tmp_path_factory.mktemp("jax_results") / "cpu.jsonl"
    runs = [
        [f"--mode={mode}", *TINY, "--steps=2", *([f"--results_file={path}"] if mode == "attention" else [])]
        for mode in ("infer", "train", "attention")
    ]
    outputs, stdout = run_benchmarks_here(runs)
    assert list(outputs) == [" ".join(args) for args in runs], stdout[-3000:]
    stdout += f"TensorFlow imported: {'tensorflow' in sys.modules}"
    return {args[0].removeprefix("--mode="): outputs[" ".join(args)] for args in runs}, stdout, results.read_rows(path)


@pytest.mark.slow
@pytest.mark.environment("jax_without_tensorflow")
@pytest.mark.parametrize("mode", ["infer", "train", "attention"])
def test_benchmark_on_jax_without_tensorflow(jax_runs, mode):
    """The model, `predict`/`fit` and the benchmark run on JAX with no TensorFlow importable; the
    attention as `jax.nn.dot_product_attention` (JAX's own formulation) matches the explicit form."""
    outputs, stdout, rows = jax_runs
    assert "backend jax" in outputs[mode] and "TensorFlow imported: False" in stdout, stdout
    if mode == "attention":
        difference, largest = _fused_explicit_difference(outputs[mode])
        assert largest > 0 and difference <= 1e-5 * max(1.0, largest)
        # The backward pass too: training-mode weight gradients of both forms.
        gradients = re.search(r"largest \|explicit\| of a weight: ([\d.e+-]+)", outputs[mode])
        assert gradients and float(gradients.group(1)) <= 1e-4, outputs[mode]
        # Its row, written without TensorFlow.
        (row,) = rows
        assert row["backend"] == "jax" and row["xla"] is True and "onednn" not in row["device"]
        assert f"{row['figures']['gradient_relative_difference']:.3g}" == gradients.group(1)
        assert row["figures"]["cudnn_attention"] == {f: False for f in ("fused", "explicit", "fused training",
                                                                       "explicit training")}  # fmt: skip
    else:
        assert re.search(r"keras_vit \(XLA\)\s+[\d,]+\s+[\d.]+", outputs[mode]), outputs[mode]


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


# === Helpers of the benchmark ===


def test_hlo_instructions_finds_matmuls_through_fusions():
    # One instruction per line, as XLA prints them (a line ending in a backslash goes on in the next).
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
  ROOT %b = f32[3,2,2]{2,1,0} dot(%s0, %s0), lhs_batch_dims={0}, lhs_contracting_dims={2}, \
rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%fused_add (r0: f32[2,2]) -> f32[2,2] {
  %r0 = f32[2,2]{1,0} parameter(0)
  ROOT %a = f32[2,2]{1,0} add(%r0, %r0)
}

ENTRY %main (x: f32[2,2]) -> f32[2,2] {
  %x = f32[2,2]{1,0} parameter(0)
  %MatMul.3 = f32[2,2]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}, \
metadata={op_type="MatMul" op_name="block/mlp/MatMul"}
  %add_fusion.1 = f32[2,2]{1,0} fusion(%MatMul.3), kind=kLoop, calls=%fused_add, \
metadata={op_type="AddV2" op_name="block/attention_norm/add"}
  %call.2 = f32[2,2]{1,0} call(%add_fusion.1), to_apply=%outer
  %y = f32[3,2,2]{2,1,0} broadcast(%x), dimensions={1,2}
  %logits = f32[3,2,2]{2,1,0} dot(%y, %y), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, \
rhs_contracting_dims={1}, metadata={op_type="BatchMatMulV2" op_name="block/attention/MatMul"}
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


def test_cpu_flags_name_the_features_present_and_nothing_where_they_are_absent(tmp_path):
    line = "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16\n"
    intel = tmp_path / "intel"
    intel.write_text(f"processor\t: 0\nmodel name\t: Some Xeon\n{line}\nprocessor\t: 1\n{line}")
    assert results.cpu_flags(intel) == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                                        "amx_int8"]  # fmt: skip
    older = tmp_path / "older"
    older.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert results.cpu_flags(older) == ["avx2"]
    bare = tmp_path / "bare"
    bare.write_text("processor\t: 0\nflags\t\t: fpu sse2\n")
    assert results.cpu_flags(bare) == []
    assert results.cpu_flags(tmp_path / "missing") == []  # not Linux


@pytest.mark.slow  # a fresh process importing TensorFlow, 5 s
def test_threads_are_set_before_tensorflow_starts_or_refused_with_the_reason():
    code = (
        "import os, tensorflow as tf; from experiments.benchmark.peaks import use_threads; "
        "print(use_threads(1), tf.config.threading.get_intra_op_parallelism_threads()); tf.constant(1.0) + 1; "
        "print(use_threads(1)); use_threads(2)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["1", "1", "1"], result.stdout + result.stderr[-2000:]
    assert result.returncode == 1
    assert "--threads=2: TensorFlow already runs 1 threads per op in this process" in result.stderr
