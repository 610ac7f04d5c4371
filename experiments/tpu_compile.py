r"""Compiles the training job's step for a Cloud TPU slice on this machine, and says whether it fits.

    KERAS_BACKEND=jax python -m experiments.tpu_compile --variant=B/16 --topology=v5e:2x2 --global_batch=256
    KERAS_BACKEND=jax python -m experiments.tpu_compile --variant=L/16 --topology=v5e:2x2 --find_batch
    KERAS_BACKEND=jax python -m experiments.tpu_compile --variant=H/14 --topology=v5p:2x2x1 --layout=model
    KERAS_BACKEND=jax python -m experiments.tpu_compile --variant=B/16 --topology=v6e:2x2 --mode=serve

Needs JAX with the TPU compiler (`pip install "jax[tpu]"`), no TPU.  The step is the one `model.fit` runs in
`python -m experiments.train` with the same --config on Keras' JAX backend: the job's model, optimizer and
schedule, MixUp/CutMix inside the step, gradient accumulation and the moving average as the config sets them,
under `keras.distribution`'s DataParallel (--layout=data) or ModelParallel (--layout=model, the blocks split
by heads over the mesh's model axis; docs/distributed.md).  --mode=serve compiles `model.predict`'s step.

Prints one line of JSON and appends it to --results_file: the bytes each chip holds as the compiler reports
them, the chip's memory, FLOPs per chip against `keras_vit.flops`' count (`recompute_overhead`: how much the
compiler recomputes to make the step fit), whether it fits (compiled, at most 3% recomputed, and room left
for the input pipeline's batches), and with --with_input the images/s a chip trains at half its peak against
the images/s one host core's input pipeline delivers.  --find_batch searches for the largest global batch that
fits.  A step that does not fit at all is one message saying by how much (exit status 2).
"""

import datetime
import json
import os
import pathlib
import sys
import time

# Before JAX loads libtpu (keras_vit.aot.topology_devices): compiles may run beside each other.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import keras  # noqa: E402
from absl import flags, logging  # noqa: E402

from experiments import jobs, models  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_FILE = ROOT / "results" / "tpu_compile.jsonl"
INPUT_RESULTS = ROOT / "results" / "cpu.jsonl"
# A step "fits" when the compiler recomputes at most this share of the model's FLOPs to make it fit.
MAX_RECOMPUTE = 0.03
# Batches of uint8 pixels the input pipeline keeps on each chip beside the step (Keras' JAX trainer runs one
# batch ahead), which the compiler does not count.
INPUT_BATCHES = 2
# The schedule's length, for the learning rate's constants only: the program does not depend on it.
SCHEDULE_STEPS = 100_000


def define_flags():
    config, _ = jobs.define_config_and_workdir("experiments/configs/imagenet_s16.py", "", "Unused.")
    return {
        "config": config,
        "variant": flags.DEFINE_string("variant", None, "The model's variant (default: the config's)."),
        "image_size": flags.DEFINE_integer("image_size", None, "The image size (default: the config's)."),
        "topology": flags.DEFINE_string("topology", "v5e:2x2", "The TPU slice, e.g. v5e:2x2, v4:2x2x1, v6e:4x4."),
        "global_batch": flags.DEFINE_integer("global_batch", None, "Global batch (default: the config's)."),
        "precision": flags.DEFINE_enum(
            "precision", None, ["float32", "mixed_bfloat16", "bfloat16"], "Dtype policy (default: the config's)."
        ),
        "layout": flags.DEFINE_enum("layout", "data", ["data", "model"], "DataParallel or ModelParallel."),
        "mesh_shape": flags.DEFINE_list("mesh_shape", None, "--layout=model: the (batch, model) mesh."),
        "mode": flags.DEFINE_enum("mode", "train", ["train", "serve"], "fit's step or predict's."),
        "find_batch": flags.DEFINE_bool("find_batch", False, "Search for the largest global batch that fits."),
        "with_input": flags.DEFINE_bool(
            "with_input", False, "Add the input pipeline's rate per host core (results/cpu.jsonl's newest "
            "`experiments.benchmark --mode=input` row) and the host cores a chip needs."
        ),
        "results_file": flags.DEFINE_string("results_file", str(RESULTS_FILE), "JSON lines appended here ('' none)."),
    }


def setting_from(config, *, variant=None, image_size=None, precision=None):
    """The config with the command's overrides applied (a copy)."""
    config = config.copy_and_resolve_references()
    if variant:
        from keras_vit.variants import parse_variant

        # A pre-logits layer as wide as the model (big_vision's rep_size=True) stays as wide as the new one.
        if config.model.get("representation_size") == models.vit_config(config).hidden_dim:
            config.model.representation_size = parse_variant(variant).hidden_dim
        config.model.variant = variant
    if image_size:
        config.image_size = image_size
    if precision:
        config.precision = precision
    return config


def build_job_model(config, num_classes):
    """The training job's model, compiled as `experiments.train` compiles it (its optimizer, schedule, loss,
    metrics, MixUp/CutMix and accumulation), with its variables on this host."""
    keras.utils.set_random_seed(config.seed)
    keras.mixed_precision.set_global_policy(config.precision)
    model = models.build_model(config, num_classes)
    if config.freeze_backbone:
        import keras_vit

        keras_vit.freeze_backbone(model)
    warmup = min(config.warmup_steps or config.warmup_epochs * 1000, SCHEDULE_STEPS - 1)
    models.compile_model(model, config, models.make_optimizer(config, SCHEDULE_STEPS, warmup, model=model))
    return model


def analytic_flops(config, num_classes, training):
    """`keras_vit.flops.count_flops` of one image through the config's model."""
    from keras_vit.flops import count_flops

    model = dict(config.model)
    variant = model.pop("variant")
    fields = {k: v for k, v in model.items() if k in ("classifier", "representation_size", "patch_size",
                                                       "hidden_dim", "num_layers", "num_heads", "mlp_dim")}
    return count_flops(variant, image_size=config.image_size, num_classes=num_classes, training=training,
                       **fields)  # fmt: skip


def make_distribution(layout, topology_devices, global_batch, config, mesh_shape=None):
    from keras_vit import distribute

    kind = {"data": "data_parallel", "model": "model_parallel"}[layout]
    shape = tuple(int(n) for n in mesh_shape) if mesh_shape else None
    return distribute.make_distribution(
        kind, shape, batch_size=global_batch, config=models.vit_config(config), devices=topology_devices
    )


def compile_once(config, topology, global_batch, *, layout="data", mesh_shape=None, mode="train", model=None):
    """Compiles the step once; returns (row, compiled step). The row is what the command prints."""
    import jax
    import numpy as np

    from keras_vit import aot

    chip = aot.chip(topology)
    devices = aot.topology_devices(topology)
    chips = aot.chip_count(devices)
    num_classes = config.num_classes or 1000
    model = model or build_job_model(config, num_classes)
    distribution = make_distribution(layout, devices, global_batch, config, mesh_shape)
    size = config.image_size
    images = jax.ShapeDtypeStruct((global_batch, size, size, 3), np.uint8)
    if mode == "train":
        labels = jax.ShapeDtypeStruct((global_batch, num_classes), np.float32)
        step = aot.compile_train_step(model, distribution, (images, labels))
    else:
        step = aot.compile_predict_step(model, distribution, images)
    analytic = analytic_flops(config, num_classes, training=mode == "train") * global_batch / chips
    memory = step.bytes_per_chip
    input_bytes = INPUT_BATCHES * global_batch // chips * size * size * 3
    overhead = step.flops_per_chip / analytic - 1
    mesh = distribution.device_mesh
    row = {
        "variant": config.model.variant,
        "image_size": size,
        "topology": topology,
        "chips": chips,
        "chip_kind": chip.name,
        "global_batch": global_batch,
        "batch_per_chip": global_batch / chips,
        "precision": config.precision,
        "layout": layout,
        "mesh": dict(zip(mesh.axis_names, (int(n) for n in mesh.shape))),
        "mode": mode,
        "compile_seconds": round(step.compile_seconds, 1),
        "bytes_per_chip": memory,
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "hbm_source": chip.source,
        "input_bytes_per_chip": input_bytes,
        "fits": overhead <= MAX_RECOMPUTE and memory["total"] + input_bytes <= chip.hbm_bytes,
        "flops_per_chip": step.flops_per_chip,
        "analytic_flops_per_chip": analytic,
        "recompute_overhead": round(overhead, 4),
        # Dots and convolutions with a float32 operand under bfloat16 (the float32 head's among them).
        "float32_matmuls": len(aot.float32_matmuls(step.hlo)) if "bfloat16" in config.precision else None,
        "host_transfers": len(aot.host_transfers(step.hlo)),
        "attention_padding": round(aot.attention_padding(step.hlo)["ratio"] or 1.0, 3),
    }
    return row, step


def find_batch(config, topology, *, layout="data", mesh_shape=None, mode="train", report=None):
    """The largest global batch that fits (`largest_fitting_batch`), compiling the job's step; returns the
    answer's row with the search's trail under "search"."""
    from keras_vit import aot

    devices = aot.topology_devices(topology)
    model = build_job_model(config, config.num_classes or 1000)
    shards = make_distribution(layout, devices, 8 * len(devices), config, mesh_shape).device_mesh.shape[0]

    def attempt(batch):
        try:
            row, _ = compile_once(config, topology, batch, layout=layout, mesh_shape=mesh_shape, mode=mode,
                                  model=model)  # fmt: skip
        except aot.DoesNotFitError as error:
            row = {"global_batch": batch, "fits": False, "error": str(error)}
        row["compiles"] = "error" not in row
        if report:
            report(row)
        return row

    return largest_fitting_batch(attempt, 8 * shards, aot.chip(topology).hbm_bytes)


def largest_fitting_batch(attempt, unit, hbm_bytes):
    """The largest multiple of `unit` for which `attempt(batch)` (a row with "fits", "compiles" and, when it
    compiles, "bytes_per_chip" and "input_bytes_per_chip") fits; the answer's row, with the trail under
    "search" and the step at twice the answer (whether it compiles and what it recomputes) under
    "search"/"twice".

    Two small batches give the memory's fixed part and its part per `unit`: the batch that would fill the chip
    is tried first; above it, batches 1, 2, 4, ... `unit`s further while they fit; then a bisection between
    the largest batch known to fit and the smallest known not to, down to one `unit`. The compiler's
    recomputation is not monotonic in the batch, so the answer is the largest batch that fits with the next
    one `unit` larger not fitting, and twice the answer is compiled to show what a larger batch costs.
    """
    tried = {}

    def at(batch):
        if batch not in tried:
            tried[batch] = attempt(batch)
        return tried[batch]

    def held(row):
        return row["bytes_per_chip"]["total"] + row["input_bytes_per_chip"]

    small, larger = at(unit), at(2 * unit)
    if not small["fits"]:
        return dict(small, search={"tried": _trail(tried)})
    fits, fails = (2 * unit, None) if larger["fits"] else (unit, 2 * unit)
    if fails is None:
        guess = 4 * unit
        if larger["compiles"] and held(larger) > held(small):
            per_unit = held(larger) - held(small)
            guess = max(3, int((hbm_bytes - (held(small) - per_unit)) // per_unit)) * unit
        batch, step = guess, unit
        while at(batch)["fits"]:  # Galloping up: a step twice as long after each batch that fits.
            fits, batch, step = batch, batch + step, 2 * step
        fails = batch
    while fails - fits > unit:
        middle = (fits + fails) // (2 * unit) * unit
        if at(middle)["fits"]:
            fits = middle
        else:
            fails = middle
    batch = fits
    answer = at(batch)
    twice = at(2 * batch)
    return dict(answer, search={
        "tried": _trail(tried),
        "twice": {"global_batch": 2 * batch, "compiles": twice["compiles"],
                  "recompute_overhead": twice.get("recompute_overhead")},
    })  # fmt: skip


def _trail(tried):
    return {
        str(batch): {"compiles": row["compiles"], "fits": row["fits"], "recompute_overhead": row.get(
            "recompute_overhead")} for batch, row in sorted(tried.items())
    }  # fmt: skip


def with_input(row, results=INPUT_RESULTS):
    """Adds the host's side: images/s a chip trains at half its bf16 peak, and the host cores that takes at the
    rate per core of the newest `experiments.benchmark --mode=input` row in `results`."""
    from experiments.benchmark.results import read_rows
    from keras_vit import aot

    chip = aot.chip(row["topology"])
    per_image = row["flops_per_chip"] / row["batch_per_chip"]
    rate = 0.5 * chip.bf16_flops_per_second / per_image
    inputs = [r for r in read_rows(results) if r["mode"] == "input" and r["config"].get("randaugment")]
    if not inputs:
        raise ValueError(f"No `experiments.benchmark --mode=input` row with RandAugment in {results}.")
    newest = inputs[-1]
    per_core = newest["figures"]["images_per_second_per_core"]["keras_vit"]
    row["input"] = {
        "chip_images_per_second_at_half_peak": round(rate, 1),
        "chip_bf16_flops_per_second": chip.bf16_flops_per_second,
        "host_images_per_second_per_core": round(per_core, 1),
        "host_cores_needed_per_chip": round(rate / per_core, 1),
        "host_cores_per_chip": chip.host_vcpus / chip.host_chips,
        "host_vm": chip.host_vm,
        "input_measured": {"date": newest["date"], "cpu": newest["device"]["cpu"], "command": newest["command"]},
    }
    return row


def provenance(argv=None):
    from experiments.benchmark.results import git_commit, library_versions
    from experiments.benchmark.timing import cpu_name

    commit, dirty = git_commit()
    command = ["KERAS_BACKEND=jax", "python", "-m", "experiments.tpu_compile", *(argv or sys.argv)[1:]]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(a for a in command if not a.startswith("--results_file")),
        "commit": commit,
        "dirty": dirty,
        "versions": {k: v for k, v in library_versions().items() if k in ("keras", "jax", "jaxlib", "python")}
        | {"libtpu": _version("libtpu")},
        "host": {"cpu": cpu_name(), "cores": os.cpu_count()},
    }


def _version(name):
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(cli):
    from experiments.benchmark.results import append_row
    from keras_vit import aot

    if keras.backend.backend() != "jax":
        raise ValueError(
            f"Compiling for a TPU runs on Keras' JAX backend; this is {keras.backend.backend()!r}. Run with "
            "KERAS_BACKEND=jax."
        )
    config = setting_from(cli.config.value, variant=cli.variant.value, image_size=cli.image_size.value,
                          precision=cli.precision.value)  # fmt: skip
    topology, layout, mode = cli.topology.value, cli.layout.value, cli.mode.value
    try:
        aot.topology_devices(topology)  # A clear error before anything is built.
    except aot.NoTPUCompilerError as error:
        raise ValueError(str(error)) from error
    start = time.perf_counter()
    if cli.find_batch.value:
        row = find_batch(config, topology, layout=layout, mesh_shape=cli.mesh_shape.value, mode=mode,
                         report=lambda r: logging.info("Global batch %d: %s", r["global_batch"], {
                             k: r.get(k) for k in ("compiles", "fits", "recompute_overhead", "error")}))
        if not row["fits"]:
            raise aot.DoesNotFitError(f"No global batch fits {topology}: {row.get('error', '')}")
    else:
        batch = cli.global_batch.value or config.batch_size
        row, _ = compile_once(config, topology, batch, layout=layout, mesh_shape=cli.mesh_shape.value, mode=mode)
    if cli.with_input.value and mode == "train":  # The training pipeline's rate: a training question.
        with_input(row)
    row.update(provenance())
    row["seconds"] = round(time.perf_counter() - start, 1)
    logging.info("Compiled in %.0f s", row["seconds"])
    print(json.dumps(row, sort_keys=True))
    if cli.results_file.value:
        append_row(cli.results_file.value, row)


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
