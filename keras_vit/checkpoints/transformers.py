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
)
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
    """Whether `state_dict` is a transformers ViT's (`ViTModel` or `ViTForImageClassification`)."""
    return MARKER in state_dict or BACKBONE + MARKER in state_dict


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
    return name if name.startswith(HEAD) else BACKBONE + name


def from_transformers(state_dict):
    """A transformers ViT state dict -> timm's names (what `keras_vit.checkpoints.timm.from_timm` reads).

    Returns (timm state dict, notes).  Raises CheckpointError naming the
    keys that have no place in a ViT of this library (a `ViTMAE`,
    `ViTHybrid` or DeiT-distilled checkpoint, for example).
    """
    converted, notes, unknown = {}, [], []
    for key, value in state_dict.items():
        name = key[len(BACKBONE):] if key.startswith(BACKBONE) else key
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
            "embeddings, class token, optional pooler, linear classifier)."
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
        elif name.startswith(HEAD):
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
