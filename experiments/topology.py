"""Where a job runs, decided once: `topology` gives the `Topology` every stage of the training job reads, and
`distribute_on_jax` sets the `keras.distribution` of Keras' JAX backend from the command's flags."""

import dataclasses

import keras
from absl import logging

from experiments import models
from keras_vit import callbacks, distribute
from keras_vit.distribute import is_chief


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where the job runs, decided once (`topology`) and read by every stage: the backend, the tf.distribute
    strategy (TensorFlow; None on the other backends), whether this process is the chief (it writes the job's
    outputs; the others write theirs under workers/WORKER), this process's index and how many train together."""

    backend: str
    strategy: object
    chief: bool
    worker: int
    workers: int

    def agree(self):
        """The function every process calls after each step so that a signal stops them all at one step
        (`keras_vit.callbacks.StopOnSignal`'s `agree`); None for one process."""
        if self.workers < 2:
            return None
        return callbacks.any_process() if self.backend == "jax" else distribute.any_replica(self.strategy)


def topology(strategy=None):
    """The job's `Topology`: on TensorFlow `strategy` (by default the one whose scope is entered, else none:
    TensorFlow's default strategy) and its cluster; on JAX the processes of `keras.distribution`; otherwise one
    process. A strategy on another backend is refused."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        strategy = strategy or tf.distribute.get_strategy()
        worker = getattr(getattr(strategy, "cluster_resolver", None), "task_id", None) or 0
        return Topology(backend, strategy, is_chief(strategy), worker, distribute.num_workers(strategy))
    if strategy is not None:
        raise ValueError(
            f"A tf.distribute strategy needs Keras' TensorFlow backend; this is {backend!r}. "
            "On JAX, set a keras.distribution (keras_vit.distribute.make_distribution). "
            f"Received: strategy={strategy!r}"
        )
    if backend == "jax":
        import jax

        return Topology(backend, None, jax.process_index() == 0, jax.process_index(), jax.process_count())
    return Topology(backend, None, True, 0, 1)


def distribute_on_jax(config, kind="auto", mesh_shape=None, multi_host=False):
    """Sets the keras.distribution of --distribution, --mesh_shape and --multi_host (Keras' JAX backend).

    `kind` is "auto" (data parallel over several devices, else none), "none",
    "data_parallel" or "model_parallel"; `mesh_shape` the (batch, model) mesh,
    by default `keras_vit.distribute.make_distribution`'s.
    """
    if multi_host:
        # Reads the coordinator from the environment (KERAS_DISTRIBUTION_* or the TPU pod's own).
        keras.distribution.initialize()
    if kind == "auto":
        kind = "data_parallel" if len(keras.distribution.list_devices()) > 1 else "none"
    if kind == "none":
        logging.info("Distribution: none (one device)")
        return
    mesh_shape = tuple(int(n) for n in mesh_shape) if mesh_shape else None
    distribution = distribute.make_distribution(
        kind, mesh_shape, batch_size=config.batch_size, config=models.vit_config(config)
    )
    keras.distribution.set_distribution(distribution)
    logging.info(
        "Distribution: %s over a %s mesh %s", type(distribution).__name__,
        dict(zip(distribution.device_mesh.axis_names, distribution.device_mesh.shape)),
        "of this host's devices" if not multi_host else "across hosts",
    )
