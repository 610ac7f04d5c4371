"""Compiling a Keras model's steps for a Cloud TPU slice ahead of time, on a host with no TPU (JAX backend).

The TPU compiler ships on the package index as `libtpu` (`pip install "jax[tpu]"`), and JAX can target a TPU
topology it is not running on: `jax.experimental.topologies.get_topology_desc` describes the slice's devices,
and a `jax.jit` function lowered with abstract arguments laid out on a mesh of them compiles to the program
the slice would run.  What the compiler then reports is its own: the bytes each chip holds
(`memory_analysis`) and the FLOPs each chip computes (`cost_analysis`).  MaxText's `train_compile.py` and
axlearn's `run_aot_compilation.py` check their models this way before a run.

    >>> devices = topology_devices("v5e:2x2")                      # doctest: +SKIP
    >>> distribution = keras_vit.distribute.make_distribution(       # doctest: +SKIP
    ...     "data_parallel", devices=devices)
    >>> step = compile_train_step(model, distribution, batch)      # doctest: +SKIP
    >>> step.bytes_per_chip["total"], step.flops_per_chip          # doctest: +SKIP

The step compiled is the one Keras' JAX trainer runs in `fit`: `jax.jit(model.train_step, donate_argnums=0)`
with the state's layouts as its outputs' (so the state is donated, its buffers reused, as in `fit`), the
variables laid out as the `keras.distribution` says and the batch split over its batch axis.  The model,
its optimizer and its metrics are built on the host (their variables' shapes are all that is read), never
placed on the TPU devices, which do not exist here.

Two things the compiler does that a reading must respect: it rematerialises (recomputes activations in the
backward pass) to make a step fit its chip's memory, so "it compiles" is not "it fits": the FLOPs it reports
then exceed the model's (`recompute_overhead`); and its `optimal_seconds` estimate is not a time (it came out
negative for whole training steps), so nothing here reads it.
"""

import dataclasses
import math
import os
import re
import time

import keras

from keras_vit import compat

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """A Cloud TPU generation, as Google's documentation gives it (per chip), and its usual host VM."""

    name: str
    hbm_bytes: int
    bf16_flops_per_second: float
    host_vcpus: int  # of the host VM below
    host_chips: int  # chips that VM holds
    host_vm: str
    source: str
    chip_config: str = "default"  # get_topology_desc's chip_config_name: "megacore" where JAX sees one device a chip


# Keyed by the topology name's prefix ("v5e:2x2" -> "v5e").
CHIPS = {
    "v4": Chip(
        "TPU v4", 32 * GIB, 275e12, 240, 4, "v4-8",
        "https://cloud.google.com/tpu/docs/v4 (32 GiB HBM2, 275 TFLOPS bf16, two TensorCores run as one "
        "megacore device); host: https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus "
        "(ct4p-hightpu-4t: 240 vCPUs)",
        chip_config="megacore",
    ),
    "v5e": Chip(
        "TPU v5 lite", 16 * GIB, 197e12, 112, 4, "v5litepod-4 (ct5lp-hightpu-4t)",
        "https://cloud.google.com/tpu/docs/v5e (16 GB HBM2e, 197 TFLOPS bf16; ct5lp-hightpu-4t: 112 vCPUs, "
        "4 chips)",
    ),
    "v5p": Chip(
        "TPU v5", 95 * GIB, 459e12, 208, 4, "v5p-8",
        "https://cloud.google.com/tpu/docs/v5p (95 GiB HBM2e, 459 TFLOPS bf16, megacore; 208 vCPUs per "
        "4-chip VM)",
    ),
    "v6e": Chip(
        "TPU v6 lite", 32 * GIB, 918e12, 180, 4, "v6e-4 (ct6e-standard-4t)",
        "https://cloud.google.com/tpu/docs/v6e (32 GB HBM, 918 TFLOPS bf16; ct6e-standard-4t: 180 vCPUs, "
        "4 chips)",
    ),
}

# Topologies of 4 to 16 chips that the compiler accepts, by generation (others may compile too).
KNOWN_TOPOLOGIES = {
    "v4": ("2x2x1", "2x2x2", "2x2x4"),
    "v5e": ("2x2", "2x4", "4x4"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4"),
    "v6e": ("2x2", "2x4", "4x4"),
}


class NoTPUCompilerError(RuntimeError):
    """libtpu (the TPU compiler) is not installed, or JAX is not."""


def known_topologies():
    """["v4:2x2x1", ...]: the names `topology_devices` is known to accept."""
    return [f"{kind}:{shape}" for kind, shapes in KNOWN_TOPOLOGIES.items() for shape in shapes]


def chip(topology):
    """The `Chip` of a topology name ("v5e:2x2")."""
    kind = topology.split(":", 1)[0]
    if kind not in CHIPS:
        raise ValueError(
            f"Unknown TPU generation {kind!r} in topology={topology!r}. Expected one of {sorted(CHIPS)}, as in "
            f"{', '.join(known_topologies())}."
        )
    return CHIPS[kind]


def topology_devices(topology):
    """The devices of a TPU slice ("v5e:2x2", "v4:2x2x1", ...) as the TPU compiler describes them, one per chip.

    Raises:
        NoTPUCompilerError: JAX or libtpu is not installed (says how to install them).
        ValueError: the compiler does not know the topology (lists the known ones).
    """
    spec = chip(topology)
    # libtpu locks a file so that one process at a time drives a machine's TPUs; compiling drives none, and
    # several compiles (a batch search beside a test) may run at once. Read when JAX first loads libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies
    except ImportError as error:
        raise NoTPUCompilerError(
            f"Compiling for a TPU needs JAX and the TPU compiler: pip install \"jax[tpu]\" ({error})"
        ) from error
    try:
        import libtpu  # noqa: F401
    except ImportError as error:
        raise NoTPUCompilerError(
            "The TPU compiler (libtpu) is not installed. It comes with JAX's TPU extra, on any machine (no TPU "
            f"is needed to compile): pip install \"jax[tpu]\" ({error})"
        ) from error
    try:
        description = topologies.get_topology_desc(
            topology_name=topology, platform="tpu", chip_config_name=spec.chip_config
        )
    except Exception as error:  # JaxRuntimeError: INVALID_ARGUMENT and others, raised by libtpu.
        raise ValueError(
            f"The TPU compiler does not know the topology {topology!r}: {str(error).splitlines()[0]}. Known: "
            f"{', '.join(known_topologies())}."
        ) from error
    return list(description.devices)


def chip_count(devices):
    """How many chips the devices are on (their distinct coordinates)."""
    return len({tuple(device.coords) for device in devices})


# === Compiling ===


@dataclasses.dataclass
class CompiledStep:
    """A step compiled for a TPU slice, and what the compiler says of it (per chip)."""

    compiled: object  # jax.stages.Compiled
    compile_seconds: float
    chips: int
    arguments: tuple = ()  # (state, batch) as the abstract values it was compiled for
    model: object = None

    @property
    def bytes_per_chip(self):
        """{"arguments", "outputs", "aliased", "temporaries", "code", "total"}: `memory_analysis`'s bytes.

        "total" is what a chip holds while the step runs: its arguments, the outputs that are not written over
        donated arguments, the temporaries and the program; the input pipeline's buffers come on top.
        """
        stats = self.compiled.memory_analysis()
        figures = {
            "arguments": stats.argument_size_in_bytes,
            "outputs": stats.output_size_in_bytes,
            "aliased": stats.alias_size_in_bytes,
            "temporaries": stats.temp_size_in_bytes,
            "code": stats.generated_code_size_in_bytes,
        }
        figures["total"] = (
            figures["arguments"] + figures["outputs"] - figures["aliased"] + figures["temporaries"] + figures["code"]
        )
        return figures

    @property
    def flops_per_chip(self):
        """The FLOPs of one step on one chip, as the compiler counts them (`cost_analysis`)."""
        analysis = self.compiled.cost_analysis()
        if isinstance(analysis, (list, tuple)):
            analysis = analysis[0]
        return float(analysis["flops"])

    @property
    def hlo(self):
        """The optimised program (HLO text) the chip runs."""
        return self.compiled.as_text()


class DoesNotFitError(ValueError):
    """The compiler found the step too large for the chip's memory."""

    def __init__(self, message, needed_bytes=None, available_bytes=None):
        super().__init__(message)
        self.needed_bytes, self.available_bytes = needed_bytes, available_bytes


def abstract_state(model, distribution, *, optimizer=True, metrics=True):
    """The JAX trainer's state `(trainable, non_trainable[, optimizer][, metrics])` as `jax.ShapeDtypeStruct`s
    laid out as `distribution` lays out each variable in `fit`.

    An optimizer variable made for a model variable (a moment, a moving average) takes that variable's layout,
    as Keras' `add_variable_from_reference` gives it when `fit` builds the optimizer under the distribution; it
    is found by the name that method gives it ("{path with '/' as '_'}_{name}") and its shape.
    """
    import jax

    def spec(variable, layout=None):
        layout = layout or distribution.get_variable_layout(variable)
        return jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=layout.backend_layout)

    trainable = {v.path.replace("/", "_") + "_": v for v in model.trainable_variables}

    def reference_layout(variable):
        matches = [p for p in trainable if variable.name.startswith(p) and trainable[p].shape == variable.shape]
        return distribution.get_variable_layout(trainable[max(matches, key=len)]) if matches else None

    state = [[spec(v) for v in model.trainable_variables], [spec(v) for v in model.non_trainable_variables]]
    if optimizer:
        state.append([spec(v, reference_layout(v)) for v in model.optimizer.variables])
    if metrics:
        state.append([spec(v) for v in model.metrics_variables])
    return tuple(state)


def abstract_batch(distribution, batch):
    """`batch` (a structure of arrays or `jax.ShapeDtypeStruct`s) with the distribution's data layouts."""
    import jax

    def spec(value):
        layout = distribution.get_data_layout(tuple(value.shape))
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=layout.backend_layout)

    return keras.tree.map_structure(spec, batch)


def compile_train_step(model, distribution, batch):
    """`model.fit`'s training step compiled for the devices of `distribution` (a `keras.distribution` over TPU
    topology devices). `model` is compiled (`model.compile`); `batch` is one global batch, `(images, labels)`,
    as arrays or `jax.ShapeDtypeStruct`s. Raises `DoesNotFitError` when the chip's memory is too small."""
    import jax

    compat.build_for_fit(model, batch)
    with distribution.scope():  # The batch mixer and accumulation read it while the step is traced.
        state = abstract_state(model, distribution)
        data = abstract_batch(distribution, batch)
        shardings = keras.tree.map_structure(lambda s: s.sharding, state)
        step = jax.jit(model.train_step, donate_argnums=0, out_shardings=(None, shardings))
        return _compile(step, (state, data), distribution, model)


def compile_predict_step(model, distribution, images):
    """`model.predict`'s step compiled for the devices of `distribution`; `images` is one global batch."""
    import jax

    with distribution.scope():
        state = abstract_state(model, distribution, optimizer=False, metrics=False)
        data = abstract_batch(distribution, (images,))
        shardings = keras.tree.map_structure(lambda s: s.sharding, state)

        def predict_step(state, data):  # As Keras' JAX trainer wraps it: the weights are passed through.
            outputs, non_trainable = model.predict_step(state, data)
            return outputs, (state[0], non_trainable)

        step = jax.jit(predict_step, donate_argnums=0, out_shardings=(None, shardings))
        return _compile(step, (state, data), distribution, model)


def _compile(step, arguments, distribution, model):
    lowered = step.lower(*arguments)
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as error:  # JaxRuntimeError: RESOURCE_EXHAUSTED when the step does not fit.
        does_not_fit = _does_not_fit(error)
        if does_not_fit is None:
            raise
        raise does_not_fit from error
    seconds = time.perf_counter() - start
    return CompiledStep(compiled, seconds, chip_count(distribution.device_mesh.devices.flatten()), arguments, model)


# The two forms of the compiler's message: "Used 17.1G of 15.75G hbm. Exceeded hbm capacity by ...", and "the
# total memory required for HLO temporaries (58.13G) exceeds available HBM (15.75G)".
_OUT_OF_MEMORY = (
    re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm", re.IGNORECASE),
    re.compile(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)", re.IGNORECASE),
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _does_not_fit(error):
    """A `DoesNotFitError` saying by how much, when `error` is the compiler's out-of-memory error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    match = next((m for m in (p.search(text) for p in _OUT_OF_MEMORY) if m), None)
    needed = available = None
    if match:
        needed = float(match.group(1)) * _UNITS[match.group(2).upper()]
        available = float(match.group(3)) * _UNITS[match.group(4).upper()]
        what = (
            f"it needs {needed / GIB:.2f} GiB per chip, {(needed - available) / GIB:.2f} GiB more than the "
            f"{available / GIB:.2f} GiB the compiler can use"
        )
    else:
        what = text.splitlines()[0][:300]
    return DoesNotFitError(f"The step does not fit the chip's memory: {what}.", needed, available)


# === Reading the compiled program ===

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%?[\w.-]+) = (\w+)\[([\d,]*)\](\{[^}]*\})? ([\w-]+)\((.*)$")
_OPERAND = re.compile(r"%?([\w.-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def instructions(hlo):
    """[Instruction] of every array-valued instruction of a compiled program's HLO text, fusions' bodies
    included (the compiled program prints operands by name only; their types are read from their
    definitions)."""
    found = []
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, dtype, dims, layout, op, rest = match.groups()
        depth, end = 0, len(rest)
        for i, c in enumerate(rest):  # The operands end at the parenthesis that closes the op's.
            depth += c == "("
            if c == ")":
                if depth == 0:
                    end = i
                    break
                depth -= 1
        op_name = _OP_NAME.search(line)
        found.append(Instruction(
            name.lstrip("%"), op, dtype, tuple(int(d) for d in dims.split(",") if d), layout or "",
            tuple(_OPERAND.match(o.strip()).group(1) for o in rest[:end].split(",") if o.strip().startswith("%")),
            op_name.group(1) if op_name else "", line.strip(),
        ))  # fmt: skip
    return found


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    op: str
    dtype: str  # "bf16", "f32", ...
    shape: tuple
    layout: str  # "{2,1,0:T(8,128)(2,1)}": the minor-to-major order, then the TPU's tiling
    operands: tuple  # names
    op_name: str  # the JAX operation it came from ("jit(train_step)/jvp(encoderblock_0)/attention/dot_general")
    text: str


def matmuls(hlo):
    """[(instruction, operand dtypes)] of every dot and convolution in the program (the TPU compiler turns
    dots into convolutions)."""
    program = instructions(hlo)
    types = {i.name: i.dtype for i in program}
    return [(i, tuple(types.get(o, "?") for o in i.operands)) for i in program if i.op in ("dot", "convolution")]


def float32_matmuls(hlo):
    """The dots and convolutions with a float32 operand: those that do not run at the bfloat16 rate."""
    return [instruction for instruction, operands in matmuls(hlo) if "f32" in operands]


_HOST_OPS = ("outfeed", "infeed", "send", "recv", "send-done", "recv-done")
_HOST_CALLS = re.compile(r'custom_call_target="[^"]*(callback|host)[^"]*"', re.IGNORECASE)


def host_transfers(hlo):
    """Lines of the program that talk to the host: infeed/outfeed, host send/recv, Python callbacks."""
    found = []
    for line in hlo.splitlines():
        op = re.search(r"= \S+ ([\w-]+)\(", line)
        op = op.group(1) if op else ""
        if op in _HOST_OPS or "is_host_transfer=true" in line or (op == "custom-call" and _HOST_CALLS.search(line)):
            found.append(line.strip()[:200])
    return found


_TILE = re.compile(r"^\{([\d,]*):T\(([\d,]+)\)")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def padded_shape(instruction):
    """The shape of `instruction`'s array as the chip stores it: its first tile (the layout's `T(a,b)`) rounds
    the most minor dimension up to a multiple of b and the next one up to a multiple of a."""
    match = _TILE.match(instruction.layout)
    shape = list(instruction.shape)
    if not match or not shape:
        return tuple(shape)
    order = [int(d) for d in match.group(1).split(",") if d]  # minor to major
    tile = [int(t) for t in match.group(2).split(",")]
    for dim, size in zip(order, reversed(tile)):
        shape[dim] = -(-shape[dim] // size) * size
    return tuple(shape)


def attention_padding(hlo):
    """What the chip's tiling adds to the attention's matmul outputs (logits, probabilities times values, and
    their gradients): {"logical_bytes", "padded_bytes", "ratio", "shapes": {logical: padded}}."""
    logical = padded = 0
    shapes = {}
    for instruction, _ in matmuls(hlo):
        if "/attention/" not in instruction.op_name or "dot_general" not in instruction.op_name:
            continue
        size = _BYTES.get(instruction.dtype, 4)
        stored = padded_shape(instruction)
        logical += size * math.prod(instruction.shape)
        padded += size * math.prod(stored)
        shapes[str(instruction.shape)] = str(stored)
    return {"logical_bytes": logical, "padded_bytes": padded, "ratio": padded / logical if logical else None,
            "shapes": shapes}  # fmt: skip

