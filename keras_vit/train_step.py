"""The training step `fit` runs: MixUp/CutMix first, then gradient accumulation, around the model's own step.

Gradient accumulation (`enable_gradient_accumulation(model, steps)`) splits
each training batch into `steps` micro-batches inside the compiled step,
runs the model's own training step on each in turn (a loop: one micro-batch's
activations in memory at a time), and applies the sum of their gradients
(each of its loss divided by `steps`) once.  The optimizer, its schedule, its moving average and the step counter
see one update per batch, as with the large batch; the data pipeline still
delivers the large batch (its uint8 pixels are small beside the activations).
Micro-batch `i` is examples `i, i + steps, i + 2 steps, ...` of the batch, so
that under `keras.distribution` each device splits its own shard.

With equal micro-batches and a loss averaged over the batch (Keras' default
reduction), that sum is the large batch's gradient: the update is the one the large batch makes, to float rounding.
Clipping, weight decay, loss scaling (mixed float16) and, under a
`tf.distribute` strategy, the cross-replica sum happen once, in that update:
each replica accumulates its own share and the gradients are summed across
replicas once per batch.  Metrics and the loss are averaged over every
micro-batch.  Dropout and stochastic depth draw anew for each micro-batch.

Keras optimizers take `gradient_accumulation_steps` too, but they count
every micro-batch as an optimizer call: under a multi-replica
`tf.distribute` strategy they fail (the cross-replica sum sits inside a
conditional), and their moving average moves at every micro-batch.

MixUp/CutMix (`keras_vit.enable_batch_mixing`) mixes the whole batch before
it is split, with one draw per batch, as with the large batch.

The model's own step is reused, traced once per micro-batch loop: the loss it
hands to `optimizer.scale_loss` is divided by `steps` (so the micro-batch
gradients sum to the large batch's, and a float16 backward pass sees the
large batch's magnitudes: it overflows, and the loss scale drops, where the
large batch's would), and its gradients are caught where it hands them to
the optimizer (`optimizer.apply_gradients` on TensorFlow,
`optimizer.stateless_apply` on JAX).
"""

import keras
from keras import ops

# The model attributes that hold what the step does; `install` composes them.
_MIXER = "_keras_vit_mixer"
_ACCUMULATION = "_keras_vit_accumulation_steps"
_BACKENDS = ("tensorflow", "jax")


def enable_gradient_accumulation(model, steps):
    """Makes `model.fit` split each training batch into `steps` micro-batches and update once per batch.

    Call it before or after `compile`, in or out of a strategy's scope; the
    next `fit` uses it.  `steps=1` turns it off.  The batch (under a
    `tf.distribute` strategy, each replica's share) must be a multiple of
    `steps`.  TensorFlow and JAX backends.

    Args:
        model: a Keras model.
        steps: micro-batches per batch, an integer >= 1.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"`steps` must be an integer >= 1. Received: steps={steps!r}")
    if steps > 1 and keras.backend.backend() not in _BACKENDS:
        raise ValueError(
            f"Gradient accumulation runs on the TensorFlow and JAX backends; this is {keras.backend.backend()!r}."
        )
    setattr(model, _ACCUMULATION, steps)
    install(model)


def set_mixer(model, mixer):
    """Makes `model.fit` mix each batch with `mixer` (a `keras_vit.BatchMixer`) before anything else."""
    setattr(model, _MIXER, mixer)
    install(model)


def install(model):
    """Sets `model.train_step` to what `enable_batch_mixing` and `enable_gradient_accumulation` asked for."""
    if keras.backend.backend() == "jax" and keras.config.is_nnx_enabled():
        raise ValueError(
            "keras_vit's training steps (batch mixing, gradient accumulation) do not support Keras' Flax NNX "
            "mode, whose `fit` calls the class's train_step, not the model's."
        )
    jax = keras.backend.backend() == "jax"
    step = type(model).train_step  # The class's: installing twice does not wrap twice.
    steps = vars(model).get(_ACCUMULATION, 1)
    if steps > 1:
        step = _jax_accumulating(step, steps) if jax else _tf_accumulating(step, steps)
    mixer = vars(model).get(_MIXER)
    if mixer is not None and mixer.enabled:
        step = mixer.training_step(step, jax=jax)
    if "train_step" in vars(model):
        del model.train_step
    if step is not type(model).train_step:
        model.train_step = lambda *args: step(model, *args)
    # A step already built (by an earlier `fit`) is rebuilt with the new one.
    model.train_function = None


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


def _caught(optimizer, steps, name, catch, run):
    """Runs `run()` (the model's step, being traced) with `optimizer.<name>` replaced by `catch` and
    `optimizer.scale_loss` dividing the loss by `steps` first; the optimizer is as it was after."""
    before = {key: vars(optimizer)[key] for key in (name, "scale_loss") if key in vars(optimizer)}
    scale_loss = optimizer.scale_loss
    optimizer.scale_loss = lambda loss: scale_loss(ops.divide(loss, steps))
    setattr(optimizer, name, catch)
    try:
        return run()
    finally:
        for key in (name, "scale_loss"):
            if key in before:
                setattr(optimizer, key, before[key])
            else:
                delattr(optimizer, key)


def _one_call(gradients, name):
    if len(gradients) != 1:
        raise RuntimeError(
            f"Gradient accumulation expected the model's train_step to call optimizer.{name} once; it was "
            f"called {len(gradients)} times."
        )
    return gradients[0]


def _tf_accumulating(model_step, steps):
    import tensorflow as tf

    def dense(gradient):  # An embedding's sparse gradient (IndexedSlices) is summed as a tensor.
        return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient

    def step(model, data):
        optimizer, variables = model.optimizer, model.trainable_weights

        def micro_step(index):
            gradients = []
            logs = _caught(
                optimizer, steps, "apply_gradients", lambda pairs: gradients.append([dense(g) for g, _ in pairs]),
                lambda: model_step(model, micro_batch(data, steps, index)),
            )
            return _one_call(gradients, "apply_gradients"), logs

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

    return step


def _jax_accumulating(model_step, steps):
    import jax

    def step(model, state, data):
        optimizer = model.optimizer

        def micro_step(state, index):
            gradients = []

            def catch(optimizer_variables, grads, trainable_variables):
                gradients.append(grads)
                return trainable_variables, optimizer_variables

            logs, state = _caught(
                optimizer, steps, "stateless_apply", catch,
                lambda: model_step(model, state, micro_batch(data, steps, index)),
            )
            return _one_call(gradients, "stateless_apply"), logs, state

        first, logs, state = micro_step(state, 0)

        def body(index, carry):
            total, _, state = carry
            gradients, logs, state = micro_step(state, index)
            return jax.tree.map(lambda t, g: t + g, total, gradients), logs, state

        # lax.fori_loop runs the micro-batches one after the other.
        total, logs, state = jax.lax.fori_loop(1, steps, body, (first, logs, state))
        trainable, non_trainable, optimizer_variables, metrics = state
        trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, total, trainable)
        return logs, (trainable, non_trainable, optimizer_variables, metrics)

    return step
