"""The command line of every job in experiments/: `run_job` defines a job's flags when it runs as a program,
never on import, so that the jobs can be imported together, as libraries, without side effects; the job's
`main` then runs with them.  The helpers the jobs build from (`models`, `datasets`, `evaluations`, `outputs`)
take a config, never a flag."""

import sys
import types

from absl import app, flags
from ml_collections import config_flags


def define_config_and_workdir(config_file, workdir, workdir_help):
    """Defines --config (a Python config file, default `config_file`, whose fields `--config.FIELD=VALUE`
    overrides) and --workdir; returns their flag holders (config, workdir)."""
    return (
        config_flags.DEFINE_config_file("config", config_file, "Python config file; fields can be overridden."),
        flags.DEFINE_string("workdir", workdir, workdir_help),
    )


def run_job(main, define_flags):
    """Runs a job from the command line: `define_flags()` defines its flags and returns them (a dict of name to
    flag holder), absl parses the command line, then `main(flags)` runs with them as attributes.

    Called from a job's `if __name__ == "__main__":` block only, so that no
    flag is defined when a job is imported.  Positional arguments are refused.
    """
    job_flags = types.SimpleNamespace(**define_flags())
    for holder in vars(job_flags).values():
        # --help lists the program's own flags: these, wherever they were defined (--config and --workdir here).
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[holder.name])

    def absl_main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        main(job_flags)

    app.run(absl_main)
