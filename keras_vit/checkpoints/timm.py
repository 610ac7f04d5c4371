"""timm's Vision Transformer state dicts: their names and layouts to and from the original checkpoints'.

timm (huggingface/pytorch-image-models) publishes its ViTs, among them the
original and AugReg Google weights it converted, as PyTorch state dicts in
`model.safetensors` files (e.g. the hub repository
`timm/vit_base_patch16_224.augreg2_in21k_ft_in1k`). This module converts their
names and layouts to and from the original checkpoints' (those
`keras_vit.checkpoints.google` reads), so `load_pretrained` takes them like an
`.npz`. timm's name, then the original name (`T/` stands for `Transformer/`,
`.../` for `T/encoderblock_{i}/`), then what changes:

- `patch_embed.proj.weight` (D, C, P, P), `.bias` -> `embedding/kernel`
  (P, P, C, D), `/bias`: transposed;
- `cls_token` (1, 1, D) -> `cls`;
- `reg_token` (1, R, D) -> `reg` (register tokens, build_vit `num_registers`);
- `pos_embed` (1, [1 +] [R +] N, D) -> `T/posembed_input/pos_embedding`
  (1 + N rows): a zero class-token row where timm's `no_embed_class` left it
  out; the registers' rows, where timm has them, added to the registers
  (their positions never change, so the sum is the same function);
- `norm_pre.*` -> `pre_norm/*` (build_vit `pre_norm=True`);
- `blocks.{i}.norm1.*`, `norm2.*` -> `.../LayerNorm_0/*`, `LayerNorm_2/*`:
  weight -> scale;
- `blocks.{i}.attn.qkv.weight` (3D, D), `.bias`, or `attn.{q,k,v}.*` ->
  `.../MultiHeadDotProductAttention_1/{query,key,value}/kernel`
  (D, heads, head_dim), `bias`: rows split, transposed;
- `blocks.{i}.attn.proj.*` -> `.../out/kernel` (heads, head_dim, D),
  `out/bias`: transposed;
- `blocks.{i}.mlp.fc1.*`, `fc2.*` -> `.../MlpBlock_3/Dense_0/*`, `Dense_1/*`:
  Linear (out, in) -> kernel (in, out);
- `blocks.{i}.ls1.gamma`, `ls2.gamma` (D,) -> `.../LayerScale_0/scale`,
  `LayerScale_1/scale` (build_vit `layer_scale`);
- a gated MLP (build_vit `mlp="swiglu"`): `blocks.{i}.mlp.fc1_g.*`, `fc1_x.*`
  -> `.../MlpBlock_3/Gate_0/*`, `Dense_0/*`; timm's packed form (`GluMlp`,
  DINOv2 giant: one `mlp.fc1` of twice the rows `mlp.fc2` reads) is split,
  the gate first;
- `blocks.{i}.attn.norm.*`, `mlp.norm.*` (BEiT-3's sub-LN) -> `.../SubNorm/*` of the attention and
  `MlpBlock_3` (build_vit `sub_norms`);
- parallel blocks (timm's `ParallelThingsBlock`, build_vit `parallel`): `blocks.{i}.attns.{j}.{norm,attn,ls}`,
  `ffns.{j}.{norm,mlp,ls}` -> branch j read as a block of its own, `Transformer/encoderblock_{i}_{j}/` (j = 0:
  `encoderblock_{i}`), with a Block's names;
- `patch_embed.norm.*` -> `embedding_norm/*` (build_vit `patch_norm`); an
  RMSNorm (`norm="rms"`) has a `weight` and no `bias`;
- a projection without a bias where this model has one (AIMv2's `attn.proj`
  and MLP, a `norm_pre` model's patch embedding) gets a zero bias, with a note;
- `norm.*` -> `T/encoder_norm/*`;
- `fc_norm.*` (GAP heads) -> `pooled_norm/*` (build_vit `pooled_norm=True`);
- `attn_pool.{latent, q, kv, proj, norm, mlp.fc1, mlp.fc2}` ->
  `MAPHead_0/{probe, MultiHeadDotProductAttention_0/{query, key + value, out},
  LayerNorm_0, MlpBlock_0/Dense_0, Dense_1}`;
- `pre_logits.fc.*`, `head.*` -> `pre_logits/*`, `head/*`: transposed;
- DeiT's distilled models: `dist_token` (1, 1, D) -> `dist`, `head_dist.*` -> `head_dist/*` (build_vit
  `distillation="head"`); their `pos_embed` has rows for both tokens.

Conversion is pure functions on dicts of NumPy arrays (`from_timm`, `to_timm`);
`keras_vit.checkpoints.formats` reads and writes the `.safetensors` files and
`keras_vit.checkpoints.model_io.save_timm` writes a model in this layout.
"""

import re

import numpy as np

from keras_vit.checkpoints.base import BLOCK_ATTENTION, MAP_ATTENTION, POSEMB, CheckpointError, square_side

# timm's key that every ViT state dict has: how a timm file is told from an original one.
MARKER = "patch_embed.proj.weight"

# === The name table ===

# How an array's layout changes between timm and the original checkpoints.
_SAME = "same"  # identical
_LINEAR = "linear"  # torch Linear weight (out, in) <-> kernel (in, out)
_CONV = "conv"  # (D, C, P, P) <-> (P, P, C, D)
_PROJECTION_KERNEL = "projection_kernel"  # (n * D, D) <-> n kernels (D, heads, head_dim)
_PROJECTION_BIAS = "projection_bias"  # (n * D,) <-> n biases (heads, head_dim)
_OUT = "out"  # (D, D) <-> (heads, head_dim, D)

_BLOCK = "Transformer/encoderblock_{i}/"
_BLOCK_ATTENTION = _BLOCK + BLOCK_ATTENTION


def _norm(timm, ours):
    return [(f"{timm}.weight", (f"{ours}/scale",), _SAME), (f"{timm}.bias", (f"{ours}/bias",), _SAME)]


def _linear(timm, ours):
    return [(f"{timm}.weight", (f"{ours}/kernel",), _LINEAR), (f"{timm}.bias", (f"{ours}/bias",), _SAME)]


def _projections(timm, attention, names):
    return [
        (f"{timm}.weight", tuple(f"{attention}/{name}/kernel" for name in names), _PROJECTION_KERNEL),
        (f"{timm}.bias", tuple(f"{attention}/{name}/bias" for name in names), _PROJECTION_BIAS),
    ]


def _attention(timm, attention):
    return [
        (f"{timm}.proj.weight", (f"{attention}/out/kernel",), _OUT),
        (f"{timm}.proj.bias", (f"{attention}/out/bias",), _SAME),
    ]


# (timm key, original keys, layout); "{i}" stands for a block's index. Where two rules give the
# same original keys (fused or split query/key/value), `to_timm` writes the first.
RULES = (
    ("cls_token", ("cls",), _SAME),
    ("reg_token", ("reg",), _SAME),
    ("dist_token", ("dist",), _SAME),
    ("pos_embed", (POSEMB,), _SAME),
    ("patch_embed.proj.weight", ("embedding/kernel",), _CONV),
    ("patch_embed.proj.bias", ("embedding/bias",), _SAME),
    *_norm("patch_embed.norm", "embedding_norm"),
    *_norm("norm_pre", "pre_norm"),
    *_norm("blocks.{i}.norm1", _BLOCK + "LayerNorm_0"),
    *_projections("blocks.{i}.attn.qkv", _BLOCK_ATTENTION, ("query", "key", "value")),
    *_projections("blocks.{i}.attn.q", _BLOCK_ATTENTION, ("query",)),
    *_projections("blocks.{i}.attn.k", _BLOCK_ATTENTION, ("key",)),
    *_projections("blocks.{i}.attn.v", _BLOCK_ATTENTION, ("value",)),
    *_attention("blocks.{i}.attn", _BLOCK_ATTENTION),
    ("blocks.{i}.ls1.gamma", (_BLOCK + "LayerScale_0/scale",), _SAME),
    ("blocks.{i}.ls2.gamma", (_BLOCK + "LayerScale_1/scale",), _SAME),
    *_norm("blocks.{i}.norm2", _BLOCK + "LayerNorm_2"),
    # A gated MLP's two halves; `to_timm` writes them only where the gate is (else `mlp.fc1`, below).
    *_linear("blocks.{i}.mlp.fc1_g", _BLOCK + "MlpBlock_3/Gate_0"),
    *_linear("blocks.{i}.mlp.fc1_x", _BLOCK + "MlpBlock_3/Dense_0"),
    *_linear("blocks.{i}.mlp.fc1", _BLOCK + "MlpBlock_3/Dense_0"),
    *_linear("blocks.{i}.mlp.fc2", _BLOCK + "MlpBlock_3/Dense_1"),
    *_norm("blocks.{i}.attn.norm", _BLOCK_ATTENTION + "/SubNorm"),
    *_norm("blocks.{i}.mlp.norm", _BLOCK + "MlpBlock_3/SubNorm"),
    *_norm("norm", "Transformer/encoder_norm"),
    *_norm("fc_norm", "pooled_norm"),
    ("attn_pool.latent", ("MAPHead_0/probe",), _SAME),
    *_projections("attn_pool.q", MAP_ATTENTION, ("query",)),
    *_projections("attn_pool.kv", MAP_ATTENTION, ("key", "value")),
    *_attention("attn_pool", MAP_ATTENTION),
    *_norm("attn_pool.norm", "MAPHead_0/LayerNorm_0"),
    *_linear("attn_pool.mlp.fc1", "MAPHead_0/MlpBlock_0/Dense_0"),
    *_linear("attn_pool.mlp.fc2", "MAPHead_0/MlpBlock_0/Dense_1"),
    *_linear("pre_logits.fc", "pre_logits"),
    *_linear("head", "head"),
    *_linear("head_dist", "head_dist"),
)

# Parts of timm's ViT family this model does not have, by a piece of their keys.
UNSUPPORTED = {
    ".in_proj.": "parallel blocks with fused projections (timm ParallelScalingBlock)",
    "q_norm": "query-key normalisation (timm qk_norm)",
    "k_norm": "query-key normalisation (timm qk_norm)",
}


def _pattern(template):
    """A template with "{i}" as a regular expression capturing the block index (`3`, or `3_1` for branch 1 of a
    parallel block 3)."""
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+(?:_\d+)?)") + "$")


# timm's ParallelThingsBlock: `blocks.{i}.attns.{j}.{norm,attn,ls}` and `ffns.{j}.{norm,mlp,ls}`; branch j of block i
# reads as a block `{i}_{j}` (`{i}` for j = 0) with a Block's names.
_BRANCH_PARTS = {("attns", "norm"): "norm1", ("attns", "attn"): "attn", ("attns", "ls"): "ls1",
                 ("ffns", "norm"): "norm2", ("ffns", "mlp"): "mlp", ("ffns", "ls"): "ls2"}  # fmt: skip
_BLOCK_PARTS = {block: branch for branch, block in _BRANCH_PARTS.items()}


def _from_branches(state_dict):
    """timm's state dict with a parallel block's branches named as blocks (`blocks.{i}_{j}.norm1.weight`)."""
    renamed = {}
    for key, value in state_dict.items():
        match = re.match(r"^blocks\.(\d+)\.(attns|ffns)\.(\d+)\.(norm|attn|ls|mlp)\.(.+)$", key)
        if match and (match[2], match[4]) in _BRANCH_PARTS:
            block = match[1] if match[3] == "0" else f"{match[1]}_{match[3]}"
            key = f"blocks.{block}.{_BRANCH_PARTS[match[2], match[4]]}.{match[5]}"
        renamed[key] = value
    return renamed


def _to_branches(state_dict):
    """The inverse of `_from_branches`, for a model with parallel blocks (any `blocks.{i}_{j}` key)."""
    if not any(re.match(r"^blocks\.\d+_\d+\.", key) for key in state_dict):
        return state_dict
    renamed = {}
    for key, value in state_dict.items():
        match = re.match(r"^blocks\.(\d+)(?:_(\d+))?\.(norm1|attn|ls1|norm2|mlp|ls2)\.(.+)$", key)
        if match:
            group, part = _BLOCK_PARTS[match[3]]
            key = f"blocks.{match[1]}.{group}.{match[2] or 0}.{part}.{match[4]}"
        renamed[key] = value
    return renamed


_TIMM_PATTERNS = [(_pattern(rule[0]), rule) for rule in RULES]
_ORIGINAL_PATTERNS = [(_pattern(original), rule) for rule in RULES for original in rule[1]]


def timm_key(key):
    """The timm key an original key (e.g. `Transformer/encoderblock_3/LayerNorm_0/scale`) comes from
    (`blocks.3.norm1.weight`); the key itself if it has none. For messages."""
    for pattern, (timm, _, _) in _ORIGINAL_PATTERNS:
        match = pattern.match(key)
        if match:
            return timm.replace("{i}", match.group(1)) if match.groups() else timm
    return key


# === Layouts ===


def _from_timm_layout(key, value, layout, count, num_heads):
    """The original arrays (`count` of them) of the timm array `value` stored under `key`."""
    shape = value.shape
    if layout == _SAME:
        return [value]
    if layout == _LINEAR and value.ndim == 2:
        return [value.T]
    if layout == _CONV and value.ndim == 4:
        return [value.transpose(2, 3, 1, 0)]
    if layout in (_PROJECTION_KERNEL, _PROJECTION_BIAS) and value.shape[0] % (count * num_heads) == 0:
        parts = np.split(value, count, axis=0)
        if layout == _PROJECTION_BIAS and value.ndim == 1:
            return [part.reshape(num_heads, -1) for part in parts]
        if layout == _PROJECTION_KERNEL and value.ndim == 2:
            return [part.T.reshape(value.shape[1], num_heads, -1) for part in parts]
    if layout == _OUT and value.ndim == 2 and value.shape[1] % num_heads == 0:
        return [value.T.reshape(num_heads, -1, value.shape[0])]
    expected = {
        _LINEAR: "(out, in)",
        _CONV: "(D, channels, patch_h, patch_w)",
        _PROJECTION_KERNEL: f"({count} x heads x head_dim, D) with {num_heads} heads",
        _PROJECTION_BIAS: f"({count} x heads x head_dim,) with {num_heads} heads",
        _OUT: f"(D, heads x head_dim) with {num_heads} heads",
    }[layout]
    raise CheckpointError(f"The timm key {key!r} has shape {shape}; expected {expected}.")


def _to_timm_layout(values, layout):
    """The timm array of the original arrays `values` (the inverse of `_from_timm_layout`)."""
    if layout == _LINEAR:
        return values[0].T
    if layout == _CONV:
        return values[0].transpose(3, 2, 0, 1)
    if layout == _PROJECTION_KERNEL:
        return np.concatenate([v.reshape(v.shape[0], -1).T for v in values], axis=0)
    if layout == _PROJECTION_BIAS:
        return np.concatenate([v.reshape(-1) for v in values])
    if layout == _OUT:
        return values[0].reshape(-1, values[0].shape[-1]).T
    return values[0]


def from_timm(state_dict, num_heads, grid_size=None):
    """A timm ViT state dict -> the original checkpoint's names and layouts (what `canonicalize` gives).

    Args:
        state_dict: {timm key: array}, e.g. read from a `model.safetensors`.
        num_heads: the model's attention heads (the original kernels are
            (D, heads, head_dim)).
        grid_size: the model's patch grid, to tell a `pos_embed` with a
            class-token row from one without (timm's `no_embed_class`, as in
            DeiT-3 and big_vision exports) when the counts alone do not.

    Returns:
        (params, notes): the arrays in the original naming, and notes on what
        was adapted.

    Raises:
        CheckpointError naming the timm keys this model has no place for, a key
        of an unexpected shape, or a key its other keys need.
    """
    state_dict, notes = _unpacked(_from_branches(dict(state_dict)))
    params, unknown = {}, []
    for key, value in state_dict.items():
        rule = next(((match, rule) for pattern, rule in _TIMM_PATTERNS if (match := pattern.match(key))), None)
        if rule is None:
            unknown.append(key)
            continue
        match, (_, originals, layout) = rule
        index = match.group(1) if match.groups() else None
        arrays = _from_timm_layout(key, np.asarray(value), layout, len(originals), num_heads)
        for original, array in zip(originals, arrays):
            params[original.replace("{i}", index or "")] = array
    if unknown:
        features = sorted({what for key in unknown for piece, what in UNSUPPORTED.items() if piece in key})
        raise CheckpointError(
            f"The timm state dict has {len(unknown)} key(s) this model has no place for, e.g. {sorted(unknown)[:5]}"
            + (f": {', '.join(features)}" if features else "")
            + ". Supported: timm's VisionTransformer with or without a class token, a distillation token, "
            "register tokens, learned position embeddings, norm_pre, layer scale, fc_norm, a MAP head (attn_pool) "
            "and linear heads."
        )
    if "embedding/bias" not in params and "pre_norm/scale" in params and "embedding/kernel" in params:
        # timm builds the patch embedding without a bias where it has norm_pre (CLIP's layout).
        params["embedding/bias"] = np.zeros(params["embedding/kernel"].shape[-1], params["embedding/kernel"].dtype)
        notes.append("The timm file's patch embedding has no bias (norm_pre models): a zero bias set.")
    projections = [key for key in params if re.search(r"^Transformer/.*/(out|Dense_[01]|Gate_0)/kernel$", key)]
    unbiased = [key for key in projections if key[: -len("kernel")] + "bias" not in params]
    if len(unbiased) < len(projections):  # Some have biases: a missing one is missing, and is named below.
        unbiased = []
    for key in unbiased:  # The same function as no bias: AIMv2's attention outputs and MLPs.
        kernel = params[key]
        params[key[: -len("kernel")] + "bias"] = np.zeros(kernel.shape[-1], kernel.dtype)
    if unbiased:
        notes.append(f"The timm file's {len(unbiased)} projection(s) without a bias (e.g. {timm_key(unbiased[0])}): "
                     "zero biases set.")  # fmt: skip
    patches = None if grid_size is None else grid_size[0] * grid_size[1]
    if "reg" in params and POSEMB in params:
        _fold_register_positions(params, patches)
    if "cls" in params and "dist" not in params and POSEMB in params:  # timm's distilled DeiTs have both rows.
        rows = params[POSEMB].shape[1]
        if patches is not None and rows in (patches, patches + 1):
            with_row = rows == patches + 1
        else:  # Without the model's grid: a square number of rows is the patches alone.
            with_row = square_side(rows) is None
        if not with_row:
            # timm's no_embed_class: the class token has no position, i.e. a zero row.
            params[POSEMB] = np.concatenate([np.zeros_like(params[POSEMB][:, :1]), params[POSEMB]], axis=1)
    return params, notes


def _unpacked(state_dict):
    """(timm's state dict with each packed gated MLP split, notes): a block whose `mlp.fc1` has twice the rows
    `mlp.fc2` reads is timm's `GluMlp` (SwiGLUPacked), act(first half) * second half: `mlp.fc1_g` and
    `mlp.fc1_x`, as timm's `SwiGLU` names them."""
    notes = []
    for key in [k for k in state_dict if re.match(r"^blocks\.\d+\.mlp\.fc1\.weight$", k)]:
        block = key[: -len("fc1.weight")]
        fc2 = state_dict.get(block + "fc2.weight")
        fc1 = np.asarray(state_dict[key])
        if fc2 is None or fc1.ndim != 2 or np.shape(fc2)[-1] * 2 != fc1.shape[0]:
            continue
        for kind in ("weight", "bias"):
            packed = state_dict.pop(block + f"fc1.{kind}", None)
            if packed is not None:
                gate, values = np.split(np.asarray(packed), 2, axis=0)
                state_dict[block + f"fc1_g.{kind}"], state_dict[block + f"fc1_x.{kind}"] = gate, values
        if not notes:
            notes.append("The timm file's packed gated MLPs (mlp.fc1 of twice the hidden width) split into the gate "
                         "and the values.")  # fmt: skip
    return state_dict, notes


def _fold_register_positions(params, patches):
    """Where timm's `pos_embed` has rows for the register tokens (`no_embed_class=False`: class token,
    registers, patches), adds those rows to the registers and drops them: a register's position is fixed, so
    register + its row is the token the blocks see either way.  `patches`: the model's patch count, or None;
    where neither layout has that many patch rows (the file's grid is another), a square number of rows left
    after the prefix tells."""
    cls, registers = int("cls" in params) + int("dist" in params), params["reg"].shape[1]  # The rows before.
    rows = params[POSEMB].shape[1]
    rest = rows - cls - registers
    if patches is not None and patches in (rest, rows):
        fold = rest == patches
    else:  # The model's grid is not the file's: a square grid after the prefix tells.
        fold = rest > 0 and square_side(rest) is not None and square_side(rows) is None and (
            not cls or square_side(rows - 1) is None)  # fmt: skip
    if fold:
        posemb = params[POSEMB]
        params["reg"] = params["reg"] + posemb[:, cls : cls + registers]
        params[POSEMB] = np.concatenate([posemb[:, :cls], posemb[:, cls + registers :]], axis=1)


def to_timm(params):
    """The inverse of `from_timm`: original names and layouts -> a timm ViT state dict.

    The query, key and value are written fused (`attn.qkv`), the position
    embeddings with the class-token row where there is a class token and a
    zero row for each register token, as timm's VisionTransformer keeps them
    (`no_embed_class=False`).
    """
    if "reg" in params and POSEMB in params:
        cls, posemb = int("cls" in params) + int("dist" in params), params[POSEMB]
        zeros = np.zeros((1, params["reg"].shape[1], posemb.shape[-1]), posemb.dtype)
        params = {**params, POSEMB: np.concatenate([posemb[:, :cls], zeros, posemb[:, cls:]], axis=1)}
    state_dict, written = {}, set()
    for timm, originals, layout in RULES:
        pattern = _pattern(originals[0])
        for key in sorted(params):
            match = pattern.match(key)
            if not match:
                continue
            index = match.group(1) if match.groups() else ""
            keys = [original.replace("{i}", index) for original in originals]
            if any(k in written or k not in params for k in keys):
                continue
            gated = keys[0].replace("/Dense_0/", "/Gate_0/") in params
            if timm.startswith("blocks.{i}.mlp.fc1_x") and not gated:
                continue  # A plain MLP's first layer: `mlp.fc1`.
            value = _to_timm_layout([params[k] for k in keys], layout)
            state_dict[timm.replace("{i}", index)] = np.ascontiguousarray(value)
            written.update(keys)
    missing = sorted(set(params) - written)
    if missing:
        raise CheckpointError(f"No timm key is known for {missing[:5]}.")
    return _to_branches(state_dict)
