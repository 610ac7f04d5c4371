"""Helpers for tests and benchmarks of keras_vit models.

- `randomize_weights`, `random_images`: a model and inputs with no term of the
  forward pass a no-op, reproducible from a seed.
- `traced_op_times`: the time of each TensorFlow op of a function run
  without XLA, as TensorFlow's own step statistics record it.
- `hlo_instructions`, `step_part` (with `MATMULS`, `BATCHED_MATMULS`,
  `STEP_PARTS`, `OTHER_PART`): what each instruction of an XLA-compiled
  training step is (a matmul, an attention matmul, or neither) and the part
  of the step (layer norms, attention, optimizer, ...) it belongs to.

TensorFlow is imported only by the functions that need it (`traced_op_times`),
so this module imports on any Keras backend, with or without TensorFlow.
"""

import re

import numpy as np

__all__ = [
    "BATCHED_MATMULS",
    "MATMULS",
    "OTHER_PART",
    "STEP_PARTS",
    "hlo_instructions",
    "random_images",
    "randomize_weights",
    "step_part",
    "traced_op_times",
]


def randomize_weights(model, seed=0, scale=0.2, unit_scales=True):
    """Replaces every weight of `model` by values drawn from N(0, scale); returns `model`.

    Zero biases, unit LayerNorm scales, a zero head or class token would hide
    a missing or misplaced term from a parity test, and TensorFlow's graph
    optimiser folds a zero bias away, which a benchmark must not let it do.
    With `unit_scales` the norms' scales (weights named `gamma` or `scale`) are
    drawn around 1 instead of 0, so each block's normalised input keeps its
    size. The weights are drawn in `model.weights` order from NumPy's
    generator seeded with `seed`: the same seed gives the same weights.
    """
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        value = rng.normal(0.0, scale, weight.shape)
        if unit_scales and weight.name in ("gamma", "scale"):  # The scales of LayerNorms and RMSNorms.
            value += 1.0
        weight.assign(value.astype(weight.dtype))
    return model


def random_images(shape, seed=0):
    """float32 images of `shape` with integer pixel values in [0, 255], from `seed`."""
    return np.random.default_rng(seed).integers(0, 256, shape).astype("float32")


# === Op times without XLA (TensorFlow) ===


def traced_op_times(function, feed, repeats=1):
    """[(op type, seconds)] of every op that ran in `repeats` traced runs of `function` on `feed`.

    The function is traced for `feed`'s shape, frozen (weights as constants)
    and run by a TensorFlow session, once untraced as a warm-up, then with
    full tracing: the way TensorFlow collects its own step statistics, after
    its graph optimiser has fused what it fuses. Needs TensorFlow.
    """
    import tensorflow as tf

    from keras_vit.compat import convert_variables_to_constants

    spec = tf.TensorSpec(feed.shape, feed.dtype)
    frozen = convert_variables_to_constants(tf.function(function).get_concrete_function(spec))
    graph = tf.Graph()
    with graph.as_default():
        tf.import_graph_def(frozen.graph.as_graph_def(), name="")
    feeds = {frozen.inputs[0].name: feed}
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    times = []
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(frozen.outputs[0].name, feeds)
        for _ in range(repeats):
            metadata = tf.compat.v1.RunMetadata()
            session.run(frozen.outputs[0].name, feeds, options=options, run_metadata=metadata)
            times += [
                (
                    node.timeline_label.split(" = ")[1].split("(")[0],
                    (node.op_end_rel_micros - node.op_start_rel_micros) / 1e6,
                )
                for device in metadata.step_stats.dev_stats
                for node in device.node_stats
                if " = " in node.timeline_label
            ]
    return times


# === The parts of an XLA-compiled training step ===

MATMULS = "matmuls: projections, MLP, patch embedding, head"
BATCHED_MATMULS = "matmuls: attention logits and values (batched)"

# The part of a training step that an instruction which is no matmul belongs
# to, by the name of the TensorFlow op it was lowered from (the HLO
# metadata's op_name, lower-cased): the first part one of whose keys it holds.
STEP_PARTS = (
    ("optimizer (AdamW update)", ("adam", "optimizer")),
    ("layer norms", ("norm",)),
    ("attention: softmax, scaling, q/k/v layout", ("attention",)),
    ("blocks: GELU, biases, residual sums", ("encoderblock",)),
)
OTHER_PART = "other: patch embedding, head, loss, gradient sums"


def step_part(kind, op_name):
    """The part of a training step that an HLO instruction of `kind` (see
    `hlo_instructions`) lowered from the TensorFlow op `op_name` belongs to:
    `kind` itself for a matmul, else the first of `STEP_PARTS` whose keys
    `op_name` holds, else `OTHER_PART`."""
    lowered = op_name.lower()
    # A layer norm's matmuls (the channel means of the hand-written training path) count as the norm's.
    if kind and not (kind == MATMULS and "norm" in lowered):
        return kind
    part = next((part for part, keys in STEP_PARTS if any(key in lowered for key in keys)), None)
    return part or OTHER_PART


def hlo_instructions(hlo):
    """{instruction name: (kind, op_name)} of an HLO module's text (one instruction per line).

    The kind is `BATCHED_MATMULS` for a dot with batch dimensions (the
    attention's), `MATMULS` for another dot, a convolution or oneDNN's matmul
    or convolution custom call, the stronger of the two (batched first) for a
    fusion, call, loop or conditional whose computations (directly or through
    those they call) hold one, and "" otherwise. `op_name` is the name of the
    TensorFlow op the instruction was lowered from, "" where the HLO has none.
    """
    computations, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if header and "=" not in line.split("{")[0]:
            current = computations.setdefault(header.group(1), [])
            continue
        instruction = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$", line)
        if instruction is None or current is None:
            continue
        rest = instruction.group(2)
        if rest.startswith("("):  # A tuple type: skip to its closing parenthesis.
            depth, end = 0, len(rest) - 1
            for index, char in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(char, 0)
                if depth == 0:
                    end = index
                    break
            rest = rest[end + 1 :].lstrip()
        else:
            rest = rest.split(" ", 1)[1] if " " in rest else ""
        opcode = rest.split("(", 1)[0].strip()
        kind = ""
        if opcode == "dot":
            kind = BATCHED_MATMULS if re.search(r"lhs_batch_dims=\{\d", rest) else MATMULS
        elif opcode == "convolution" or (
            # oneDNN's matmul and convolution thunks (--xla_cpu_use_onednn).
            opcode == "custom-call" and re.search(r'custom_call_target="[^"]*(matmul|convolution)', rest)
        ):
            kind = MATMULS
        called = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", rest) + [
            name
            for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", rest)
            for name in re.findall(r"%([\w.\-]+)", group)
        ]
        op_name = re.search(r'op_name="([^"]*)"', rest)
        current.append((instruction.group(1), kind, called, op_name.group(1) if op_name else ""))

    kinds = {}

    def strongest(found):
        return next((kind for kind in (BATCHED_MATMULS, MATMULS) if kind in found), "")

    def kind_of(kind, called, seen):
        """The instruction's own kind, or the strongest of the computations it calls."""
        return strongest({kind, *(kind_in(c, seen) for c in called if c not in seen)})

    def kind_in(computation, seen=()):
        if computation not in kinds:
            kinds[computation] = strongest(
                {kind_of(k, c, (*seen, computation)) for _, k, c, _ in computations.get(computation, [])}
            )
        return kinds[computation]

    return {
        name: (kind_of(kind, called, ()), op_name)
        for instructions in computations.values()
        for name, kind, called, op_name in instructions
    }
