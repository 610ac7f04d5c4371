"""Benchmark results as data: one JSON object per run, appended to a JSON-lines file per platform.

A row (`make_row`) holds what a run measured and what it ran on:

- `schema`, `date` (UTC, ISO 8601), `mode`, `config` (the flags the mode reads), `backend`, `xla` (whether
  keras_vit ran XLA-compiled, where the mode says);
- `figures`: the mode's measurements (for `infer`/`train`: `images_per_second`, `params` and `of_peak` per
  implementation, `ours` naming keras_vit's, the matmul peaks and the roofline `peak_flops_per_second`);
- `ratios`: {name: {"ratio": x, "against": the implementation it was measured against}} (ours / each peer's
  faster form, ours / our float32 model, ...);
- `command`, `commit` (git's HEAD, `dirty` when tracked files differ from it), `versions` (keras, the
  backend's framework, the peers'), `device` (the accelerator or CPU, cores, CPU features, GPU driver);
- optionally `stale` (why the figures no longer describe the code) and `note`, and, for rows carried over
  from tables written by hand before the results files, `source` (where their figures were found).

`results/<platform>.jsonl` in the repository keeps the rows the documentation's tables are made of
(`python -m experiments.benchmark.tables`); e.g. `results/cpu.jsonl`, `results/gpu_h200.jsonl`.
"""

import datetime
import importlib.metadata
import json
import os
import pathlib
import shlex
import subprocess
import sys

SCHEMA = 1
ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"

# Distributions whose versions a row records, where installed.
DISTRIBUTIONS = (
    "keras", "tensorflow", "tensorflow-cpu", "tensorflow-tpu", "jax", "jaxlib", "torch", "timm", "keras-hub",
    "numpy", "ai-edge-litert",
)  # fmt: skip
# CPU features that decide which fast paths run (oneDNN's bfloat16, int8 and AMX kernels, XLA's vector code), as
# Linux's /proc/cpuinfo names them.
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# Fields every row has.
FIELDS = ("schema", "date", "mode", "config", "figures", "ratios", "command", "commit", "versions", "device")


def library_versions():
    """{distribution: version} of `DISTRIBUTIONS` installed here, JAX's CUDA plugins and Python's."""
    versions = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"] or ""
        if name.lower().startswith(("jax-cuda", "jax_cuda")):
            versions[name.lower()] = distribution.version
    versions["python"] = sys.version.split()[0]
    return versions


def git_commit(root=ROOT):
    """(HEAD's hash, whether tracked files differ from it) of the repository at `root`; (None, None)
    where there is no git or no repository."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
            timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, bool(status.strip())


def cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The `CPU_FLAGS` this CPU has, read from Linux's `cpuinfo` file; empty where there is none."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FLAGS if flag in present]
    except OSError:
        pass
    return []


def cpu_line(flags):
    """The CPU as the serving, peaks and predict modes print it: its model name and `flags` (`cpu_flags()`)."""
    from experiments.benchmark.timing import cpu_name

    return f"{cpu_name()} ({', '.join(flags) or 'no listed features'})"


def gpu_driver():
    """The NVIDIA driver's version, where `nvidia-smi` answers; else None."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip().splitlines()[0] if result.stdout.strip() else None


def device_description():
    """What the figures were measured on: the machine as the benchmark prints it, the accelerator, the
    host's CPU and cores, its CPU features, oneDNN (TensorFlow) and the GPU driver where there is one."""
    import keras

    import keras_vit
    from experiments.benchmark.timing import cpu_name, machine_name

    accelerator = keras_vit.kernels.policy.device()
    device = {
        "machine": machine_name(),
        "accelerator": accelerator,
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "cpu_flags": cpu_flags(),
    }
    if keras.backend.backend() == "tensorflow":
        from keras_vit import compat

        device["onednn"] = compat.onednn_enabled()
    if accelerator == "gpu":
        device["gpu_driver"] = gpu_driver()
    return device


def command_line(argv=None):
    """The command that ran this process, as one would type it from the repository root."""
    argv = sys.argv if argv is None else argv
    return shlex.join(["python", "-m", "experiments.benchmark", *argv[1:]])


def make_row(mode, config, measured, argv=None, date=None):
    """A results row for a run of `mode` with `config` (the flags it read) that measured `measured`
    (what the mode returned: "figures", "ratios", optionally "xla" and the peers' "versions")."""
    import keras

    commit, dirty = git_commit()
    row = {
        "schema": SCHEMA,
        "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "config": dict(config),
        "backend": keras.backend.backend(),
        "figures": measured["figures"],
        "ratios": measured.get("ratios", {}),
        "command": command_line(argv),
        "commit": commit,
        "dirty": dirty,
        "versions": {**library_versions(), **measured.get("versions", {})},
        "device": device_description(),
    }
    if "xla" in measured:
        row["xla"] = measured["xla"]
    return row


def append_row(path, row):
    """Appends `row` as one JSON line to `path` (made with its folder if missing), rewriting the file
    whole or not at all (`keras_vit.files.write_text_atomically`) so that an interrupted run leaves the previous
    rows as they were."""
    from keras_vit.files import write_text_atomically  # Here: reading rows needs no Keras.

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = path.read_text() if path.exists() else ""
    if existing and not existing.endswith("\n"):
        existing += "\n"
    write_text_atomically(path, existing + json.dumps(row, sort_keys=True) + "\n")


def read_rows(path):
    """The rows of a results file, in order; raises ValueError naming the line that is not a row."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON: {error}") from error
            missing = [field for field in FIELDS if field not in row]
            if missing:
                raise ValueError(f"{path}:{number}: a row without {missing}")
            rows.append(row)
    return rows
