"""The one package of keras_vit that uses private or undocumented Keras and TensorFlow APIs.

The rest of the package, `experiments/` and `tests/` use public APIs only, or the entries below.  Every entry
was written for the versions in `WRITTEN_FOR` and is checked down to `CHECKED_FROM`; its docstring says what
it relies on and why no public API does the job, and `tests/test_compat.py` holds a canary for each that
fails, naming the API and the versions, when what it relies on changes or goes away.

The entries, by what they adapt (one module each), what each relies on, and who calls it:

- Probes for a faster path (`probes`):
  - `onednn_enabled()`: tensorflow.python.util._pywrap_util_port.IsMklEnabled; the kernels layer.
  - `in_xla_context()`: tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext; the kernels
    layer, and keras_vit.data.randaugment (the forms of its ops that compile with XLA).
- Frozen and optimised graphs (`graphs`):
  - `convert_variables_to_constants(f)`:
    tensorflow.python.framework.convert_to_constants.convert_variables_to_constants_v2; keras_vit.testing,
    for per-op profiles.
  - `grappler_op_types(f)`: tensorflow.python.grappler.tf_optimizer.OptimizeGraph; tests of the kernels
    layer.
- Optimizers (`optimizers`):
  - `ClipAfterAllReduce`: the TensorFlow-backend optimizer's `_clip_gradients`, `_backend_update_step`,
    `_all_reduce_sum_gradients`, `_distributed_tf_update_step` and `_distribution_strategy`, and
    tf.__internal__.distribute.interim.maybe_merge_call; keras_vit.training.
  - `LearningRateScales`: the optimizer's `_get_variable_index`, `_trainable_variables`, `_use_weight_decay`
    and `_apply_weight_decay`; keras_vit.training (layer-wise learning-rate decay; without it, on TensorFlow,
    the weight decay with the learning rate computed once, through `_distribution_strategy` and
    maybe_merge_call, or Keras' own method where those changed).
  - `swap_moving_average(optimizer)`: the optimizer's `_trainable_variables` and
    `_model_variables_moving_average` (its `use_ema` averages); keras_vit.callbacks.EMAWeights.
- The training step (`trainer`):
  - `track_loss(model, loss, x)`: the model's `_loss_tracker` and
    keras.src.losses.loss.unscale_loss_for_distribution; keras_vit.train_step (gradient accumulation).
  - `update_metrics_stateless(model, ...)`: the JAX trainer's `_update_metrics_variables`;
    keras_vit.train_step (gradient accumulation on JAX).
  - `build_for_fit(model, batch)`: the trainer's `_symbolic_build`; keras_vit.aot (a step compiled ahead of
    time needs the variables `fit` makes first).
- Saving (`saving`):
  - `keep_saving_skipsets()`: keras.src.saving.saving_lib.get_attr_skipset and
    keras.src.backend.common.global_state; keras_vit.ViT.save (Keras' cache of its skip sets never hits).
- Garbage collection (`collection`):
  - `one_collection_for_deleted_variables()`: keras.src.layers.layer.Layer.__delattr__ (it runs `gc.collect`
    for each deleted variable); keras_vit.ViT's `quantize` and the loading of a quantized ViT.
- `model.fit` under MultiWorkerMirroredStrategy (`multi_worker`):
  - `patch_keras_for_multi_worker_fit()`: keras.src.backend.tensorflow.trainer
    (`TensorFlowTrainer._maybe_symbolic_build`, `reduce_per_replica`, `_collective_all_reduce_multi_worker`,
    `_is_per_replica_instance`); keras_vit.distribute.

When what an entry relies on is missing or has another signature, the entry raises `PrivateApiError` (a
RuntimeError) naming the API, the versions it was written for and the versions installed, rather than doing
something else. The two probes, `onednn_enabled` and `in_xla_context`, answer False instead: for the kernels
layer the plain path is correct everywhere, only slower; RandAugment applied inside an XLA-compiled function
would then fail to compile (rotate, shear, translate) or draw other numbers, which its canary catches first.
`keep_saving_skipsets` and `one_collection_for_deleted_variables` do nothing instead: saves and quantizing stay
correct, at Keras' own cost.

`api_problems(entry)` lists what an entry relies on that the installed versions lack ([] when all is there);
the canaries assert it is empty.

TensorFlow is imported inside the entries, so importing this package (as `keras_vit.training` does) works on
the JAX and PyTorch backends without TensorFlow installed.
"""

from keras_vit.compat.apis import (
    CHECKED_FROM,
    CHECKS,
    WRITTEN_FOR,
    PrivateApiError,
    api_problems,
    installed_versions,
)
from keras_vit.compat.collection import one_collection_for_deleted_variables
from keras_vit.compat.graphs import convert_variables_to_constants, grappler_op_types
from keras_vit.compat.multi_worker import multi_worker_fit_patched, patch_keras_for_multi_worker_fit
from keras_vit.compat.optimizers import ClipAfterAllReduce, LearningRateScales, swap_moving_average
from keras_vit.compat.probes import in_xla_context, onednn_enabled
from keras_vit.compat.saving import keep_saving_skipsets
from keras_vit.compat.trainer import build_for_fit, track_loss, update_metrics_stateless

# Every entry, in the order of the table above (each module adds its own to CHECKS).
ENTRIES = (
    "onednn_enabled",
    "in_xla_context",
    "convert_variables_to_constants",
    "grappler_op_types",
    "ClipAfterAllReduce",
    "LearningRateScales",
    "swap_moving_average",
    "track_loss",
    "update_metrics_stateless",
    "build_for_fit",
    "keep_saving_skipsets",
    "one_collection_for_deleted_variables",
    "patch_keras_for_multi_worker_fit",
)

__all__ = [
    "CHECKED_FROM",
    "CHECKS",
    "ENTRIES",
    "WRITTEN_FOR",
    "ClipAfterAllReduce",
    "LearningRateScales",
    "PrivateApiError",
    "api_problems",
    "convert_variables_to_constants",
    "grappler_op_types",
    "in_xla_context",
    "installed_versions",
    "keep_saving_skipsets",
    "multi_worker_fit_patched",
    "one_collection_for_deleted_variables",
    "onednn_enabled",
    "patch_keras_for_multi_worker_fit",
    "swap_moving_average",
    "track_loss",
    "update_metrics_stateless",
    "build_for_fit",
]
