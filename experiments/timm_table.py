r"""Writes `keras_vit/checkpoints/timm_architectures.py`: what each of timm's ViT architectures is.

    python -m experiments.timm_table --out=keras_vit/checkpoints/timm_architectures.py

Needs timm (the `bench` extra, or any Python with timm and PyTorch; keras_vit is not imported). Every
architecture registered in timm's `vision_transformer.py` and `deit.py` is built on PyTorch's "meta" device (no
memory, no weights) and its modules are read: the attention heads, the MLP's activation, the norms' epsilon,
whether it takes any image size, and the parts that change what it computes (`FEATURES`). The library decides
from that row what it builds (`keras_vit.checkpoints.readers`).
"""

import collections
import sys

from absl import app, flags

# The parts of timm's ViTs a row can name, as the generated file lists them: name -> what it is, in words.
FEATURES = {
    "layer_scale": "layer scale (timm's init_values)",
    "registers": "register tokens",
    "no_qkv_bias": "query, key and value without bias",
    "swiglu": "a gated (SwiGLU) MLP",
    "silu": "the SiLU activation",
    "rms_norm": "RMSNorm",
    "qk_norm": "query-key normalisation",
    "norms_inside": "norms inside the attention and the MLP",
    "patch_norm": "a norm in the patch embedding",
    "distillation": "DeiT's distillation token",
    "parallel_blocks": "parallel blocks",
    "fused_parallel_blocks": "parallel blocks with fused projections (timm's ParallelScalingBlock)",
    "unpooled_class_token": "a class token the head does not read (mean pooling beside it)",
    "post_norm": "post-norm blocks",
    "differential_attention": "differential attention",
}

HEADER = '''"""What timm's ViT architecture names say that their files do not: a table.

A timm `config.json` names its `architecture` (e.g. "vit_base_patch16_224") and gives only the `model_args`
that differ from the architecture's own definition; the arrays of `model.safetensors` show the widths, depth,
patch size and which parts exist, but not the number of attention heads, the activation, LayerNorm's epsilon
or options that change the function without adding weights.  Those come from this table, one row per
architecture registered in timm {version}'s `vision_transformer.py` and `deit.py`, read off each model built on
PyTorch's meta device by `python -m experiments.timm_table` (which wrote this file): (attention heads, the MLP's
activation (by the names of `keras_vit.layers.core.MLP_ACTIVATIONS`, or another's), the norms' epsilon, dynamic
image size by default, the parts in `FEATURES` it has).
"""

# The parts a row can name, in words.
FEATURES = {features}

# fmt: off
TIMM_ARCHITECTURES = {{
{rows}}}
# fmt: on
'''


def describe(model):
    """(heads, activation, epsilon, dynamic, features) of a timm ViT built on the meta device."""
    import timm.layers
    import torch

    block, features = model.blocks[0], set()
    kind = type(block).__name__
    if kind == "ParallelThingsBlock":
        features.add("parallel_blocks")
    if kind in ("ParallelScalingBlock", "DiffParallelScalingBlock"):
        features.add("fused_parallel_blocks")
    if getattr(model, "cls_token", None) is not None and model.global_pool not in ("token", "map", ""):
        features.add("unpooled_class_token")
    if kind.startswith("Diff") or type(getattr(block, "attn", None)).__name__.startswith("Diff"):
        features.add("differential_attention")
    if kind == "ResPostBlock":
        features.add("post_norm")
    if type(model).__name__ == "VisionTransformerDistilled":
        features.add("distillation")
    if getattr(model, "num_reg_tokens", 0):
        features.add("registers")
    if isinstance(getattr(block, "ls1", None), timm.layers.LayerScale):
        features.add("layer_scale")
    attention = getattr(block, "attn", None)
    heads = getattr(attention, "num_heads", None) or getattr(block, "num_heads", None)
    if attention is not None and getattr(attention, "qkv", None) is not None and attention.qkv.bias is None:
        features.add("no_qkv_bias")
    if attention is not None and not isinstance(getattr(attention, "q_norm", torch.nn.Identity()), torch.nn.Identity):
        features.add("qk_norm")
    mlp = getattr(block, "mlp", None)
    for module in (attention, mlp):
        if module is not None and not isinstance(getattr(module, "norm", torch.nn.Identity()), torch.nn.Identity):
            features.add("norms_inside")
    if not isinstance(getattr(model.patch_embed, "norm", torch.nn.Identity()), torch.nn.Identity):
        features.add("patch_norm")
    if mlp is not None and type(mlp).__name__ in ("SwiGLU", "SwiGLUPacked", "GluMlp"):
        features.add("swiglu")
    norm = getattr(block, "norm1", None) or model.norm
    if "rms" in type(norm).__name__.lower():
        features.add("rms_norm")
    act = getattr(mlp, "act", None)
    activation = {"GELUTanh": "gelu_tanh", "QuickGELU": "quick_gelu"}.get(type(act).__name__, "gelu")
    if type(act).__name__ == "GELU":
        activation = "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    elif type(act).__name__ not in ("GELUTanh", "QuickGELU", "NoneType"):
        activation = type(act).__name__.lower()
        if activation == "silu" and "swiglu" not in features:
            features.add("silu")
    if heads is None:  # Parallel blocks keep the heads in their fused attention.
        heads = next((m.num_heads for m in model.modules() if hasattr(m, "num_heads")), 0)
    return int(heads), activation, float(getattr(norm, "eps", 1e-6)), bool(model.dynamic_img_size), tuple(
        sorted(features))


def table():
    """{architecture: row} for every ViT architecture registered in timm's vision_transformer and deit."""
    import timm
    import torch

    names = sorted(set(timm.list_models(module="vision_transformer")) | set(timm.list_models(module="deit")))
    rows = {}
    with torch.device("meta"):
        for name in names:
            rows[name] = describe(timm.create_model(name))
    return timm.__version__, rows


def module_text(version, rows):
    lines = ""
    for name, row in rows.items():
        line = f"    {name!r}: {row!r},\n"
        if len(line) > 120:  # The parts on a line of their own.
            line = f"    {name!r}: (\n        {row[0]!r}, {row[1]!r}, {row[2]!r}, {row[3]!r}, {row[4]!r},\n    ),\n"
        lines += line
    features = "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in FEATURES.items()) + "}"
    return HEADER.format(version=version, features=features, rows=lines)


def main(argv):
    del argv
    version, rows = table()
    counts = collections.Counter(feature for row in rows.values() for feature in row[4])
    print(f"{len(rows)} architectures from timm {version}; features: {dict(counts)}", file=sys.stderr)
    with open(flags.FLAGS.out, "w") as f:
        f.write(module_text(version, rows))


if __name__ == "__main__":
    flags.DEFINE_string("out", "keras_vit/checkpoints/timm_architectures.py", "The module to write.")
    app.run(main)
