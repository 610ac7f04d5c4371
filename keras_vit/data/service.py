"""tf.data service: the input pipeline run on other machines' CPUs, for a host whose cores cannot keep up.

A dispatcher (one process) hands datasets to workers (any number of
processes, on CPU machines next to the accelerators); the training job
registers its pipeline with the dispatcher and reads the workers' batches
over gRPC (`tf.data.experimental.service`).  `start_dispatcher` and
`start_worker` start them (`python -m experiments.data_service` from the
command line); the training job wraps its pipeline with `distribute`.

Processing mode.  An endless, shuffled, repeated training pipeline runs in
"parallel_epochs" mode, as TF Model Garden's input reader
(`official/core/input_reader.py`) runs its own: every worker runs the whole
pipeline and the client takes the batches of whichever worker has one ready.
Nothing is split, so nothing is lost or waited for: `fit` counts steps, an
"epoch" is a number of steps, and a slow or lost worker only lowers the rate.
"distributed_epoch" (the dispatcher hands each element of a splittable source,
a file name, to one worker, once per pass) is for a pipeline that must see
every example exactly once per pass.

Seeds.  In "parallel_epochs" mode every worker runs the same serialized
graph, seeds included.  With a fixed shuffle or augmentation seed, or with
`seed=None` while a global seed is set (`keras.utils.set_random_seed`: the op
seeds then derive from it in the client), every worker produces the same
stream, and the client reads each batch once per worker.  (Model Garden
passes `seed=None`, which gives each worker its own draw only while no global
seed is set.)  `on_each_worker` builds the pipeline with no graph seed, so
that its unseeded ops draw their seeds on each worker when it starts the
pipeline, whatever the client's seeds: the workers' streams are independent.
A run through the service is therefore reproducible in its number of steps,
not batch for batch.

The workers run the serialized graph, nothing else.  `tf.py_function` and
`tf.numpy_function` call Python functions registered in the process that
built the pipeline; a worker in another process has none, and the first
element to reach one fails ("ValueError: Could not find callback with
key=pyfunc_0 in the registry").  What runs on the workers is graph-only, and
Python state of the client (a counter the pipeline fills) stays empty.  The
workers read the files themselves: the paths must be readable there (gs://, a
shared file system); they need the client's TensorFlow version, not its code.

    >>> dispatcher = start_dispatcher()
    >>> worker = start_worker(dispatcher.target)
    >>> ds = distribute(tf.data.Dataset.range(4), dispatcher.target, job_name="doc")
    >>> sorted(int(x) for x in ds)
    [0, 1, 2, 3]
    >>> worker.stop(); dispatcher.stop()
"""

import re
import secrets

import tensorflow as tf

PROCESSING_MODES = ("parallel_epochs", "distributed_epoch")

# grpc://HOST:PORT or HOST:PORT; HOST a name, an IPv4 address or a bracketed IPv6 address.
_ADDRESS = re.compile(r"(?:grpc://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})")


def parse_address(address):
    """(host, port) of a dispatcher or worker address "grpc://HOST:PORT" or "HOST:PORT".

    >>> parse_address("grpc://10.0.0.2:5050")
    ('10.0.0.2', 5050)
    >>> parse_address("dispatcher:5050")
    ('dispatcher', 5050)
    """
    match = _ADDRESS.fullmatch(address) if isinstance(address, str) else None
    port = int(match.group(2)) if match else 0
    if not match or not 0 < port < 65536:
        raise ValueError(
            "A tf.data service address is 'grpc://HOST:PORT' or 'HOST:PORT' (a port from 1 to 65535). "
            f"Received: address={address!r}"
        )
    return match.group(1), port


def distribute(dataset, address, *, job_name, processing_mode="parallel_epochs"):
    """`dataset`, processed by the tf.data service workers of the dispatcher at `address`.

    The dataset's serialized graph is registered with the dispatcher (no
    Python runs on the workers) and read from the workers as one job, named
    `job_name` and a suffix drawn for this call.  The dispatcher finds a job
    by its name alone: a second client reading under a name in use would be
    given the first one's elements, whatever its own dataset (another run, a
    restarted one, another batch size), so no two calls share a job.  Each
    input pipeline of a multi-host run is its own job on every worker.
    `processing_mode` is "parallel_epochs" (each worker runs the whole
    dataset: for an endless, shuffled training pipeline whose seeds are drawn
    on the workers, `on_each_worker`) or "distributed_epoch" (each element
    of a splittable source processed once, by one worker).
    """
    host, port = parse_address(address)
    if not isinstance(job_name, str) or not job_name:
        raise ValueError(f"`job_name` must be a non-empty string. Received: job_name={job_name!r}")
    if processing_mode not in PROCESSING_MODES:
        raise ValueError(
            f"`processing_mode` must be one of {PROCESSING_MODES}. Received: processing_mode={processing_mode!r}"
        )
    job = f"{job_name}-{secrets.token_hex(6)}"  # Not `random`: a global seed would repeat it run after run.
    return dataset.apply(
        tf.data.experimental.service.distribute(processing_mode, f"grpc://{host}:{port}", job_name=job)
    )


def on_each_worker(build):
    """The dataset `build()` makes, built so that its unseeded random ops draw their seeds where it runs.

    `build()` is traced as a function with no graph-level seed: its random
    ops given `seed=None` (shuffles, `tf.data.Dataset.random`) then get the
    seeds (0, 0), which their kernels take as "draw a seed when the pipeline
    starts", whatever seeds the client set (a global seed included).  Through
    the tf.data service, each worker draws its own: the workers' streams are
    independent.  Iterated in the client, each iteration draws anew.  An op
    given a seed of its own keeps it, the same on every worker.

    >>> ds = on_each_worker(lambda: tf.data.Dataset.range(100).shuffle(100))
    >>> sorted(int(x) for x in ds) == list(range(100))
    True
    """

    def traced(_):
        # In a function being traced this sets that graph's seed only, not the process's global seed.
        tf.compat.v1.set_random_seed(None)
        return build()

    return tf.data.Dataset.from_tensors(0).flat_map(traced)


def start_dispatcher(port=0, *, work_dir=None):
    """Starts a tf.data service dispatcher on `port` (0: any free port); returns the server.

    Its `target` ("grpc://localhost:PORT") is what workers and clients
    connect to (from other machines: this machine's name and the port).  With
    `work_dir` (local or gs://), it runs in fault-tolerant mode: it journals
    the registered datasets and jobs there before answering, so that a
    dispatcher restarted with the same `work_dir` and port resumes them.
    `join()` blocks until it stops; `stop()` stops it.
    """
    if work_dir is not None:
        tf.io.gfile.makedirs(work_dir)
    config = tf.data.experimental.service.DispatcherConfig(
        port=port, work_dir=work_dir, fault_tolerant_mode=work_dir is not None
    )
    return tf.data.experimental.service.DispatchServer(config)


def start_worker(dispatcher_address, port=0, *, worker_address=None):
    """Starts a tf.data service worker serving the dispatcher at `dispatcher_address`; returns the server.

    `port` 0 takes any free port.  `worker_address` ("HOST:PORT", or
    "HOST:%port%" for the bound port) is the address the dispatcher gives
    clients for this worker: by default "localhost:%port%", which only a
    client on the same machine can reach; a worker on another machine than
    the training job gives its own name or IP.
    """
    host, dispatcher_port = parse_address(dispatcher_address)
    if worker_address is not None:
        parse_address(worker_address.replace("%port%", "1"))
    config = tf.data.experimental.service.WorkerConfig(
        dispatcher_address=f"{host}:{dispatcher_port}", worker_address=worker_address, port=port
    )
    return tf.data.experimental.service.WorkerServer(config)
