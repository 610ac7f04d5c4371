"""Pretrained ViT checkpoints: the original Google ones (.npz), timm's and transformers' (.safetensors), read,
converted, resampled and written; and the model surgery of transfer learning.

Each module imports only the ones listed before it:

- `base`: `CheckpointError`, the keys several layouts name, the checks they share;
- `formats`: .npz and .safetensors files (local or gs:// paths) as dicts of NumPy arrays;
- `resample`: position embeddings resampled to another patch grid;
- `google`: the original checkpoints' key layouts (vit_jax, big_vision, scan, hybrids) to and from a model's
  weights;
- `timm`: timm's state dict names and layouts to and from the original ones;
- `transformers`: transformers' ViT state dict names to and from timm's;
- `model_io`: `load_pretrained`, `save_npz`, `save_timm`, `save_transformers`: files in, model out and back;
- `surgery`: `set_image_size`, `set_patch_size`, `replace_head`, `freeze_backbone`.

The conversion is pure functions on dicts of NumPy arrays (`canonicalize`, `convert_checkpoint`,
`to_checkpoint`, `from_timm`, `to_timm`, `from_transformers`, `to_transformers`); only `model_io` and `surgery`
touch a model.
"""

from keras_vit.checkpoints.base import INTERPOLATIONS, CheckpointError
from keras_vit.checkpoints.formats import (
    is_safetensors,
    read_checkpoint,
    read_npz,
    read_safetensors,
    write_npz,
    write_safetensors,
)
from keras_vit.checkpoints.google import canonicalize, convert_checkpoint, to_checkpoint
from keras_vit.checkpoints.model_io import (
    checkpoint_bytes_limit,
    load_pretrained,
    model_checkpoint,
    save_npz,
    save_timm,
    save_transformers,
)
from keras_vit.checkpoints.resample import resample_position_embeddings, resize_patch_kernel
from keras_vit.checkpoints.surgery import freeze_backbone, replace_head, set_image_size, set_patch_size
from keras_vit.checkpoints.timm import from_timm, timm_key, to_timm
from keras_vit.checkpoints.transformers import from_transformers, to_transformers, transformers_key

__all__ = [
    "checkpoint_bytes_limit",
    "INTERPOLATIONS",
    "CheckpointError",
    "canonicalize",
    "convert_checkpoint",
    "freeze_backbone",
    "from_timm",
    "is_safetensors",
    "load_pretrained",
    "model_checkpoint",
    "read_checkpoint",
    "read_npz",
    "read_safetensors",
    "replace_head",
    "resample_position_embeddings",
    "resize_patch_kernel",
    "save_npz",
    "save_timm",
    "save_transformers",
    "set_image_size",
    "set_patch_size",
    "timm_key",
    "to_checkpoint",
    "to_timm",
    "to_transformers",
    "transformers_key",
    "from_transformers",
    "write_npz",
    "write_safetensors",
]
