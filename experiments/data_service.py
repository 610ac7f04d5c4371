r"""Runs a tf.data service dispatcher or worker, for training jobs whose input pipeline outruns one host.

    python -m experiments.data_service --role=dispatcher --port=5050 \
        [--work_dir=gs://BUCKET/data_service]
    python -m experiments.data_service --role=worker --dispatcher=HOST:5050 \
        --port=5051 [--worker_address=THIS_HOST:5051]

Blocks until killed.  The training job then reads its batches from the
workers: `--config.data_service=grpc://HOST:5050`.  A worker runs the job's
pipeline (read, decode, augment, batch) as the serialized graph the job sent,
so it needs the data (gs:// or a shared file system) and the job's
TensorFlow version, not its files or its Python.  See docs/distributed.md.
"""

import time

from absl import flags, logging

from experiments import jobs
from keras_vit.data import service


def define_flags():
    """The job's flags, defined when it runs as a program (`jobs.run_job`), not on import."""
    return {
        "role": flags.DEFINE_enum("role", None, ["dispatcher", "worker"], "What this process serves.", required=True),
        "port": flags.DEFINE_integer("port", 0, "Port to serve on (0: any free port)."),
        "work_dir": flags.DEFINE_string(
            "work_dir", None, "Dispatcher: a folder (local or gs://) for its journal; with it, a restarted "
            "dispatcher (same --work_dir and --port) resumes the registered datasets and jobs."
        ),
        "dispatcher": flags.DEFINE_string("dispatcher", None, "Worker: the dispatcher's HOST:PORT or grpc://HOST:PORT."),
        "worker_address": flags.DEFINE_string(
            "worker_address", None, "Worker: the HOST:PORT clients reach this worker at (HOST:%port% for the bound "
            "port); default localhost:%port%, which only serves a training job on the same machine."
        ),
    }


def serve(role, port=0, *, work_dir=None, dispatcher=None, worker_address=None):
    """Starts the dispatcher or worker of `role`; returns (the server, a line saying what it serves)."""
    if role == "dispatcher":
        if dispatcher or worker_address:
            raise ValueError("--dispatcher and --worker_address are for --role=worker.")
        server = service.start_dispatcher(port, work_dir=work_dir)
        journal = f", journal in {work_dir} (fault tolerant)" if work_dir else ""
        return server, f"tf.data service dispatcher at {server.target}{journal}"
    if role == "worker":
        if not dispatcher:
            raise ValueError("--role=worker needs --dispatcher=HOST:PORT (the dispatcher's address).")
        if work_dir:
            raise ValueError("--work_dir is for --role=dispatcher.")
        server = service.start_worker(dispatcher, port, worker_address=worker_address)
        return server, (
            f"tf.data service worker on port {port or 'any free port'} for the dispatcher {dispatcher}, "
            f"announced to clients as {worker_address or 'localhost:%port%'}"
        )
    raise ValueError(f"`role` must be 'dispatcher' or 'worker'. Received: role={role!r}")


def main(cli):
    server, line = serve(
        cli.role.value, cli.port.value, work_dir=cli.work_dir.value, dispatcher=cli.dispatcher.value,
        worker_address=cli.worker_address.value,
    )
    logging.info("%s; serving until killed", line)
    print(line, flush=True)
    started = time.monotonic()
    try:
        server.join()
    finally:
        logging.info("Stopped after %.0f s", time.monotonic() - started)


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
