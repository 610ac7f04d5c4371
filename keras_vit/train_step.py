"""The training step `fit` runs: MixUp/CutMix first, then gradient accumulation, around Keras' own step.

`TrainingSteps` is a mixin for `keras.Model` subclasses; `keras_vit.ViT` derives from it.  Its
`train_step` (the method Keras documents for changing what `fit` does) reads two settings of the model,
`batch_mixer` and `gradient_accumulation_steps`, and with neither set is Keras' own step.  For a model of
your own: `class MyModel(keras_vit.TrainingSteps, keras.Model)`.

Gradient accumulation (`gradient_accumulation_steps = steps`) splits each training batch into `steps`
micro-batches inside the compiled step, runs the forward and backward pass on each in turn (a loop: one
micro-batch's activations in memory at a time), and applies the sum of their gradients (each of its loss
divided by `steps`) once.  The optimizer, its schedule, its moving average and the step counter see one
update per batch, as with the large batch; the data pipeline still delivers the large batch (its uint8
pixels are small beside the activations).  Micro-batch `i` is examples `i, i + steps, i + 2 steps, ...` of
the batch, so that under `keras.distribution` each device splits its own shard.

With equal micro-batches and a loss averaged over the batch (Keras' default reduction), that sum is the large
batch's gradient: the update is the one the large batch makes, to float rounding.  Clipping, weight decay,
loss scaling (mixed float16) and, under a `tf.distribute` strategy, the cross-replica sum happen once, in that
update: each replica accumulates its own share and the gradients are summed across replicas once per batch.
Metrics and the loss are averaged over every micro-batch.  Dropout and stochastic depth draw anew for each
micro-batch.  The micro-batch step is Keras' own, written with its public `compute_loss`,
`compute_loss_and_updates` (JAX), `optimizer.scale_loss` and `compute_metrics`; the loss's running mean is
updated through `keras_vit.compat`.

Keras optimizers take `gradient_accumulation_steps` too, but they count every micro-batch as an optimizer
call: under a multi-replica `tf.distribute` strategy they fail (the cross-replica sum sits inside a
conditional), and their moving average moves at every micro-batch.

MixUp/CutMix (`batch_mixer`, a `keras_vit.BatchMixer`) mixes the whole batch before it is split, with one
draw per batch, as with the large batch.
"""

import keras
from keras import ops

from keras_vit import compat

_BACKENDS = ("tensorflow", "jax")


class TrainingSteps:
    """Mixin for `keras.Model` subclasses: `fit`'s step with batch mixing and gradient accumulation.

    Put it before the Keras base class: `class MyModel(keras_vit.TrainingSteps, keras.Model)`.  The two
    settings are the model's, not saved with it (a reloaded model trains plainly until they are set again);
    setting one makes the next `fit` trace its step anew.
    """

    _batch_mixer = None
    _gradient_accumulation_steps = 1

    @property
    def batch_mixer(self):
        """The `keras_vit.BatchMixer` that mixes each training batch first, or None."""
        return self._batch_mixer

    @batch_mixer.setter
    def batch_mixer(self, mixer):
        if mixer is not None and not callable(getattr(mixer, "mix_training_batch", None)):
            raise ValueError(f"`batch_mixer` must be a keras_vit.BatchMixer or None. Received: {mixer!r}")
        self._batch_mixer = mixer
        self.train_function = None  # A step traced by an earlier `fit` is traced again.

    @property
    def gradient_accumulation_steps(self):
        """Micro-batches per training batch (1: none)."""
        return self._gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps):
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"`steps` must be an integer >= 1. Received: steps={steps!r}")
        if steps > 1 and keras.backend.backend() not in _BACKENDS:
            raise ValueError(
                "Gradient accumulation runs on the TensorFlow and JAX backends; this is "
                f"{keras.backend.backend()!r}."
            )
        self._gradient_accumulation_steps = steps
        self.train_function = None

    def fit(self, *args, **kwargs):
        """Keras' `fit`; on TensorFlow, an optimizer not built yet is built first, outside the traced step.

        Without a `tf.distribute` strategy Keras builds it inside the first trace of the training step, where
        each of its variables (two per weight for Adam) is created with an initializer function of its own, several
        times slower than built eagerly (docs/performance.md).  The variables are the same (built under the
        model's strategy scope, as Keras builds them under a strategy).
        """
        optimizer = getattr(self, "optimizer", None)
        if keras.backend.backend() == "tensorflow" and optimizer is not None and not optimizer.built:
            with self.distribute_strategy.scope():
                optimizer.build(self.trainable_variables)
        return super().fit(*args, **kwargs)

    def train_step(self, *args):
        """Keras' training step (`(data)`; on JAX `(state, data)`) with the batch mixed and accumulated."""
        jax = keras.backend.backend() == "jax"
        state, data = args if jax else (None, args[0])
        mixer = self._batch_mixer
        if mixer is not None and mixer.enabled:
            data = mixer.mix_training_batch(self, data, state)
        steps = self._gradient_accumulation_steps
        if steps == 1:
            return super().train_step(*args[:-1], data)
        return _jax_accumulated(self, state, data, steps) if jax else _tf_accumulated(self, data, steps)


def require_training_steps(model, what):
    """Raises ValueError unless `model`'s class derives from `TrainingSteps`."""
    if not isinstance(model, TrainingSteps):
        raise ValueError(
            f"{what} needs a model whose class derives from keras_vit.TrainingSteps, as keras_vit.ViT does "
            "(build_vit, from_pretrained and their saved files). Received a "
            f"{type(model).__module__}.{type(model).__name__}. For a model of your own, derive its class: "
            "`class MyModel(keras_vit.TrainingSteps, keras.Model)`."
        )


def enable_gradient_accumulation(model, steps):
    """Makes `model.fit` split each training batch into `steps` micro-batches and update once per batch.

    Call it before or after `compile`, in or out of a strategy's scope; the
    next `fit` uses it.  `steps=1` turns it off.  The batch (under a
    `tf.distribute` strategy, each replica's share) must be a multiple of
    `steps`.  TensorFlow and JAX backends.  The same as setting
    `model.gradient_accumulation_steps`.

    Args:
        model: a `keras_vit.ViT` (or a model whose class derives from `keras_vit.TrainingSteps`).
        steps: micro-batches per batch, an integer >= 1.
    """
    require_training_steps(model, "Gradient accumulation")
    model.gradient_accumulation_steps = steps


def micro_batch(data, steps, index):
    """Examples `index, index + steps, ...` of each tensor in `data` (a batch); `index` may be a tensor."""

    def take(tensor):
        shape = ops.shape(tensor)
        if isinstance(shape[0], int) and shape[0] % steps:
            raise ValueError(
                f"Gradient accumulation over {steps} micro-batches needs a batch (per replica) that is a "
                f"multiple of {steps}. Received a batch of {shape[0]} (shape {tuple(tensor.shape)})."
            )
        grouped = ops.reshape(tensor, (-1, steps, *shape[1:]))
        return ops.take(grouped, index, axis=1)

    return keras.tree.map_structure(take, data)


def _tf_accumulated(model, data, steps):
    import tensorflow as tf

    def dense(gradient):  # An embedding's sparse gradient (IndexedSlices) is summed as a tensor.
        return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient

    optimizer, variables = model.optimizer, model.trainable_weights

    def micro_step(index):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(micro_batch(data, steps, index))
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            compat.track_loss(model, loss, x)
            scaled = optimizer.scale_loss(ops.divide(loss, steps))
        gradients = [dense(g) for g in tape.gradient(scaled, variables)]
        return gradients, model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    first, logs = micro_step(0)
    present = [i for i, g in enumerate(first) if g is not None]

    def body(index, total, logs):
        gradients, logs = micro_step(index)
        return index + 1, [t + gradients[i] for t, i in zip(total, present)], logs

    # One micro-batch after the other (parallel_iterations=1): one micro-batch's activations at a time.
    _, total, logs = tf.while_loop(
        lambda index, *_: index < steps, body, (tf.constant(1), [first[i] for i in present], logs),
        parallel_iterations=1,
    )
    gradients = [None] * len(first)
    for i, t in zip(present, total):
        gradients[i] = t
    optimizer.apply_gradients(zip(gradients, variables))
    return logs


def _jax_accumulated(model, state, data, steps):
    import jax

    trainable, non_trainable, optimizer_variables, metrics_variables = state

    def loss(*args, **kwargs):  # The loss Keras differentiates (scaled for float16), divided by `steps`.
        value, aux = model.compute_loss_and_updates(*args, **kwargs)
        return value / steps, aux

    gradient_function = jax.value_and_grad(loss, has_aux=True)

    def micro_step(index, non_trainable, metrics_variables):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(micro_batch(data, steps, index))
        (_, aux), gradients = gradient_function(
            trainable, non_trainable, metrics_variables, x, y, sample_weight,
            training=True, optimizer_variables=optimizer_variables,
        )
        unscaled_loss, y_pred, non_trainable, metrics_variables = aux
        logs, metrics_variables = compat.update_metrics_stateless(
            model, metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
        )
        return gradients, logs, non_trainable, metrics_variables

    first = micro_step(0, non_trainable, metrics_variables)

    def body(index, carry):
        gradients, logs, non_trainable, metrics_variables = micro_step(index, *carry[2:])
        return jax.tree.map(lambda t, g: t + g, carry[0], gradients), logs, non_trainable, metrics_variables

    # lax.fori_loop runs the micro-batches one after the other.
    total, logs, non_trainable, metrics_variables = jax.lax.fori_loop(1, steps, body, first)
    trainable, optimizer_variables = model.optimizer.stateless_apply(optimizer_variables, total, trainable)
    return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)
