"""The jobs' model and optimizer, made from a config: the ViT of config.model, its `ViTConfig`, the optimizer
and recipe, and the compile step (loss, metrics, XLA).

    >>> from experiments.configs import digits
    >>> config = digits.get_config()
    >>> build_model(config, num_classes=10).count_params()
    139722
    >>> vit_config(config).hidden_dim, vit_config(config).patch_size
    (64, (2, 2))
"""


import keras

import keras_vit
from keras_vit import training
from keras_vit.evaluation import MAX_MATRIX_CLASSES, ConfusionAccuracy
from keras_vit.variants import ViTConfig, parse_variant


def build_model(config, num_classes, class_names=None):
    """The ViT of config.model (a variant and `build_vit`'s keyword arguments) at config.image_size, with the
    data's `class_names` (kept in the model's spec, so in every file it is saved to)."""
    model = dict(config.model)
    return keras_vit.build_vit(model.pop("variant"), image_size=config.image_size, num_classes=num_classes,
                               class_names=class_names, **model)  # fmt: skip


def vit_config(config):
    """The `ViTConfig` the job's model will have (its variant and the overrides in config.model), without
    building it: what a device mesh is planned from."""
    fields = set(ViTConfig.__dataclass_fields__)
    model = dict(config.model)
    return parse_variant(model.pop("variant"), **{k: v for k, v in model.items() if k in fields})


def make_optimizer(config, steps, warmup_steps, recipe=None, model=None):
    """`keras_vit.training.make_optimizer` for `steps` steps with `warmup_steps` of warm-up (at most steps - 1).

    The optimizer, learning rate and weight decay are `recipe`'s (by default
    config's: a job with a second recipe, such as transfer's fine-tuning,
    passes it); the decay, the gradient clipping, the moving average and the
    layer-wise decay (of `model`) are config's.  With
    config.weight_decay_kernels_only, the weight decay reaches only the
    kernels of `model` (big_vision's default), not its biases, norms and
    embeddings.
    """
    recipe = recipe or config
    optimizer = training.make_optimizer(
        recipe.optimizer,
        recipe.learning_rate,
        steps,
        min(warmup_steps, steps - 1),
        weight_decay=recipe.weight_decay,
        decay=config.decay,
        grad_clip_norm=config.grad_clip_norm,
        ema_momentum=config.get("ema_momentum", 0.0),
        layer_decay=config.get("layer_decay", 1.0),
        model=model,
    )
    if config.get("weight_decay_kernels_only") and recipe.weight_decay:
        if model is None:
            raise ValueError("config.weight_decay_kernels_only needs the model, to find its kernels.")
        optimizer.exclude_from_weight_decay(
            var_list=[w for w in model.trainable_weights if not w.name.endswith("kernel")]
        )
    return optimizer


def whole_executions(steps_per_execution, steps_per_epoch):
    """The largest divisor of `steps_per_epoch` that is at most `steps_per_execution`.

    Keras runs each execution whole: with 95 steps per epoch and 50 steps
    per execution, an epoch would run 100 steps, and the run more steps than
    its schedule has (the last ones at a learning rate of 0).
    """
    return max(n for n in range(1, min(steps_per_execution, steps_per_epoch) + 1) if steps_per_epoch % n == 0)


def accuracy_metric(num_classes):
    """The job's "accuracy": a `ConfusionAccuracy`, whose counts give the epoch figures their validation matrix,
    up to MAX_MATRIX_CLASSES (100) classes, those eval/ draws a matrix for; Keras' `CategoricalAccuracy` (the
    same values) above. The counts are updated in every step (num_classes^2 float32, summed over the devices on
    Keras' JAX backend): 40 KB at 100 classes."""
    if num_classes <= MAX_MATRIX_CLASSES:
        return ConfusionAccuracy(num_classes, name="accuracy")
    return keras.metrics.CategoricalAccuracy(name="accuracy")


def compile_model(model, config, optimizer, *, steps_per_execution=1):
    """Compiles `model` for one-hot labels: cross-entropy on logits with config.label_smoothing, accuracy,
    XLA as config.jit_compile and config.precision ask (`keras_vit.training.resolve_jit_compile`); and sets
    its training step's MixUp/CutMix (config.augment) and gradient accumulation (config.grad_accum_steps)
    when the config asks for them (they need a `keras_vit.TrainingSteps` model, such as a ViT).

    Under a strategy's scope, "auto" follows the strategy.
    """
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing),
        metrics=[accuracy_metric(model.output_shape[-1])],
        jit_compile=training.resolve_jit_compile(config.jit_compile, config.precision),
        steps_per_execution=steps_per_execution,
    )
    augment = config.augment
    if augment.mixup_alpha or augment.cutmix_alpha:
        # Inside the compiled step: uint8 batches cross to the device, mixed there.
        keras_vit.enable_batch_mixing(
            model, mixup_alpha=augment.mixup_alpha, cutmix_alpha=augment.cutmix_alpha,
            switch_prob=augment.switch_prob, seed=config.seed,
        )
    if config.grad_accum_steps != 1:
        # Each batch as config.grad_accum_steps micro-batches, one update: the batch's (mixed whole, then split).
        keras_vit.enable_gradient_accumulation(model, config.grad_accum_steps)
    return model
