"""transformers' ViT state dicts (`ViTModel`, `ViTForImageClassification`): their names to and from timm's.

The Hugging Face hub's most downloaded ViT weights, `google/vit-base-patch16-224` and its kin, are
transformers' `ViTForImageClassification`: a `model.safetensors` whose keys are the backbone's under `vit.`
and the head's under `classifier.`, beside a `config.json`.  Every array has its twin in timm's state dict
(`keras_vit.checkpoints.timm`), the query, key and value apart as timm's `attn.q`, `attn.k`, `attn.v`, in the
same layout (torch's Linear (out, in), the patch convolution (D, C, P, P)), so the conversion is a renaming;
timm's then takes them to the original checkpoints' names.  transformers' key (after `vit.`), then timm's:

- `embeddings.cls_token`, `embeddings.position_embeddings` -> `cls_token`, `pos_embed`;
- `embeddings.patch_embeddings.projection.*` -> `patch_embed.proj.*`;
- `encoder.layer.{i}.layernorm_before.*`, `layernorm_after.*` -> `blocks.{i}.norm1.*`, `norm2.*`;
- `encoder.layer.{i}.attention.attention.{query,key,value}.*` -> `blocks.{i}.attn.{q,k,v}.*`;
- `encoder.layer.{i}.attention.output.dense.*` -> `blocks.{i}.attn.proj.*`;
- `encoder.layer.{i}.intermediate.dense.*`, `output.dense.*` -> `blocks.{i}.mlp.fc1.*`, `fc2.*`;
- `layernorm.*` -> `norm.*`;
- `pooler.dense.*` (`ViTModel`'s dense + tanh on the class token) -> `pre_logits.fc.*` (the original
  representation layer, the same function: build_vit `representation_size`);
- `classifier.*` (not under `vit.`) -> `head.*`.

DeiT (`model_type` "deit", backbone under `deit.`) adds `embeddings.distillation_token` -> `dist_token` (its
position embeddings have a row for it), and `DeiTForImageClassificationWithTeacher`'s `cls_classifier.*`,
`distillation_classifier.*` -> `head.*`, `head_dist.*`.  DINOv2 (`dinov2`, `dinov2_with_registers`, under
`dinov2.`) names its blocks' norms `norm1`, `norm2`, its MLP `mlp.fc1`, `mlp.fc2`, adds
`layer_scale1.lambda1`, `layer_scale2.lambda1` -> `ls1.gamma`, `ls2.gamma` and `embeddings.register_tokens` ->
`reg_token`, and a gated MLP's `mlp.weights_in`, `mlp.weights_out` -> `mlp.fc1`, `mlp.fc2` (packed, as timm's
`GluMlp`); `Dinov2ForImageClassification`'s `classifier` reads the class token and the mean of the patch
tokens, concatenated (build_vit `classifier="token_gap"`).

`embeddings.mask_token` (used only by masked image modelling) is dropped with a note.  transformers computes
its LayerNorms with `config.layer_norm_eps` (1e-12 in the `google/vit-*` configs): build_vit's
`layer_norm_epsilon` (`keras_vit.from_pretrained` reads it from the config).
"""

import re

import numpy as np

from keras_vit.checkpoints import timm as timm_layout
from keras_vit.checkpoints.base import CheckpointError

# transformers' key that every ViT state dict has (after the `vit.` of a classification model).
MARKER = "embeddings.patch_embeddings.projection.weight"
# Where `ViTForImageClassification` keeps the backbone; `ViTModel` has no prefix.
BACKBONE = "vit."
# The backbones' prefixes of the model types read (DeiT's and DINOv2's classification models).
BACKBONES = (BACKBONE, "deit.", "dinov2.", "dinov2_with_registers.")
HEAD = "classifier."

# (transformers key without BACKBONE, timm key); "{i}" stands for a block's index; ".*" for weight and bias.
_LAYER = "encoder.layer.{i}."
RENAMES = (
    ("embeddings.cls_token", "cls_token"),
    ("embeddings.position_embeddings", "pos_embed"),
    ("embeddings.patch_embeddings.projection.*", "patch_embed.proj.*"),
    (_LAYER + "layernorm_before.*", "blocks.{i}.norm1.*"),
    (_LAYER + "attention.attention.query.*", "blocks.{i}.attn.q.*"),
    (_LAYER + "attention.attention.key.*", "blocks.{i}.attn.k.*"),
    (_LAYER + "attention.attention.value.*", "blocks.{i}.attn.v.*"),
    (_LAYER + "attention.output.dense.*", "blocks.{i}.attn.proj.*"),
    (_LAYER + "layernorm_after.*", "blocks.{i}.norm2.*"),
    (_LAYER + "intermediate.dense.*", "blocks.{i}.mlp.fc1.*"),
    (_LAYER + "output.dense.*", "blocks.{i}.mlp.fc2.*"),
    ("layernorm.*", "norm.*"),
    ("pooler.dense.*", "pre_logits.fc.*"),
    (HEAD + "*", "head.*"),
    # DeiT
    ("embeddings.distillation_token", "dist_token"),
    ("cls_classifier.*", "head.*"),
    ("distillation_classifier.*", "head_dist.*"),
    # DINOv2
    ("embeddings.register_tokens", "reg_token"),
    (_LAYER + "norm1.*", "blocks.{i}.norm1.*"),
    (_LAYER + "norm2.*", "blocks.{i}.norm2.*"),
    (_LAYER + "mlp.fc1.*", "blocks.{i}.mlp.fc1.*"),
    (_LAYER + "mlp.fc2.*", "blocks.{i}.mlp.fc2.*"),
    (_LAYER + "layer_scale1.lambda1", "blocks.{i}.ls1.gamma"),
    (_LAYER + "layer_scale2.lambda1", "blocks.{i}.ls2.gamma"),
    (_LAYER + "mlp.weights_in.*", "blocks.{i}.mlp.fc1.*"),  # DINOv2 giant's SwiGLU, packed as timm's GluMlp
    (_LAYER + "mlp.weights_out.*", "blocks.{i}.mlp.fc2.*"),
)
# The heads outside the backbone.
HEADS = (HEAD, "cls_classifier.", "distillation_classifier.")
DROPPED = ("embeddings.mask_token",)


def _expanded():
    """RENAMES with ".*" written out as ".weight" and ".bias"."""
    for ours, timm in RENAMES:
        if ours.endswith("*"):
            for suffix in ("weight", "bias"):
                yield ours[:-1] + suffix, timm[:-1] + suffix
        else:
            yield ours, timm


def _pattern(template):
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_TIMM = [(_pattern(ours), timm) for ours, timm in _expanded()]
_FROM_TIMM = [(_pattern(timm), ours) for ours, timm in _expanded()]


def is_transformers(state_dict):
    """Whether `state_dict` is a transformers ViT's (`ViTModel`, `ViTForImageClassification`, DeiT's, DINOv2's)."""
    return any(prefix + MARKER in state_dict for prefix in ("", *BACKBONES))


def _backbone_name(key):
    """`key` without its backbone prefix (`vit.`, `deit.`, `dinov2.`)."""
    return next((key[len(prefix):] for prefix in BACKBONES if key.startswith(prefix)), key)


def _rename(key, patterns):
    for pattern, template in patterns:
        match = pattern.match(key)
        if match:
            return template.replace("{i}", match.group(1)) if match.groups() else template
    return None


def transformers_key(key):
    """The transformers key an original key comes from (for messages); the key itself if it has none."""
    name = _rename(timm_layout.timm_key(key), _FROM_TIMM)
    if name is None:
        return key
    return name if name.startswith(HEADS) else BACKBONE + name


def from_transformers(state_dict):
    """A transformers ViT state dict -> timm's names (what `keras_vit.checkpoints.timm.from_timm` reads).

    Returns (timm state dict, notes).  Raises CheckpointError naming the
    keys that have no place in a ViT of this library (a `ViTMAE`,
    `ViTHybrid` or DeiT-distilled checkpoint, for example).
    """
    converted, notes, unknown = {}, [], []
    for key, value in state_dict.items():
        name = _backbone_name(key)
        if name in DROPPED:
            notes.append(f"Dropped {key!r}: masked image modelling only.")
            continue
        timm = _rename(name, _TO_TIMM)
        if timm is None:
            unknown.append(key)
        else:
            converted[timm] = np.asarray(value)
    if unknown:
        raise CheckpointError(
            f"The transformers state dict has {len(unknown)} key(s) this model has no place for, e.g. "
            f"{sorted(unknown)[:5]}. Supported: ViTModel and ViTForImageClassification (learned position "
            "embeddings, class token, optional pooler, linear classifier), DeiT's and DINOv2's."
        )
    return converted, notes


def _split_qkv(timm_state_dict):
    """timm's state dict with each fused `blocks.{i}.attn.qkv.*` as `attn.q.*`, `attn.k.*` and `attn.v.*`."""
    split = {}
    for key, value in timm_state_dict.items():
        match = re.match(r"^(blocks\.\d+\.attn)\.qkv\.(weight|bias)$", key)
        if match:
            for part, name in zip(np.split(np.asarray(value), 3, axis=0), "qkv"):
                split[f"{match[1]}.{name}.{match[2]}"] = part
        else:
            split[key] = value
    return split


def to_transformers(timm_state_dict, *, prefix=BACKBONE):
    """The inverse of `from_transformers`: timm's names (`keras_vit.checkpoints.timm.to_timm`) ->
    `ViTForImageClassification`'s (`prefix=""`: `ViTModel`'s, whose head is not written).

    timm's fused `attn.qkv` is split into the query, key and value.
    Raises CheckpointError for keys transformers' ViT has no place for
    (timm's `norm_pre`, `fc_norm`, a MAP head).
    """
    state_dict, unknown = {}, []
    for key, value in _split_qkv(timm_state_dict).items():
        name = _rename(key, _FROM_TIMM)
        if name is None:
            unknown.append(key)
        elif name.startswith(HEADS):
            if prefix:
                state_dict[name] = np.ascontiguousarray(value)
        else:
            state_dict[prefix + name] = np.ascontiguousarray(value)
    if unknown:
        raise CheckpointError(
            f"transformers' ViT has no place for {sorted(unknown)[:5]} (timm's norm_pre, fc_norm or a MAP "
            "head: build the model without pre_norm, pooled_norm and classifier='map')."
        )
    return state_dict
