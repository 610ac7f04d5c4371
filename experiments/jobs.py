"""The command line of every job in experiments/: `run_job` defines a job's flags when it runs as a program,
never on import, so that the jobs can be imported together, as libraries, without side effects; the job's
`main` then runs with them.  The helpers the jobs build from (`models`, `datasets`, `extra_test_sets`, `outputs`)
take a config, never a flag."""

import atexit
import contextlib
import os
import sys
import time
import types

import ml_collections
from absl import app, flags
from ml_collections import config_flags

# The exit status of a job stopped by a user error (a bad flag or config value, a missing file, an unknown data
# set): the message alone, on stderr; KERAS_VIT_TRACEBACK=1 shows where it was raised as well.
USER_ERROR_EXIT = 2


class Stopped(Exception):
    """A job stopped before its end with its state saved (a signal): it prints the message and exits with
    `exit_code` at once (`exit_now`)."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def define_config_and_workdir(config_file, workdir, workdir_help):
    """Defines --config (a Python config file, default `config_file`, whose fields `--config.FIELD=VALUE`
    overrides) and --workdir; returns their flag holders (config, workdir)."""
    return (
        config_flags.DEFINE_config_file("config", config_file, "Python config file; fields can be overridden."),
        flags.DEFINE_string("workdir", workdir, workdir_help),
    )


def help_text(main, job_flags):
    """What --help prints: the job's docstring, its flags and, for a job with --config, every config field with
    its default (`--config.FIELD=VALUE` sets one)."""
    module = sys.modules.get(main.__module__)
    lines = [(getattr(module, "__doc__", None) or "").strip(), "", "Flags:", flags.FLAGS.main_module_help()]
    if hasattr(job_flags, "config"):
        config = flags.FLAGS["config"].default
        lines += ["", "Config fields (--config.FIELD=VALUE), with their defaults:"]
        lines += [f"    --config.{name}={value!r}" for name, value in config_fields(config)]
    return "\n".join(lines)


def config_fields(config, prefix=""):
    """[(dotted name, value)] of every leaf field of a ConfigDict."""
    fields = []
    for name in sorted(config.keys()):
        value = config[name]
        if isinstance(value, ml_collections.ConfigDict):
            fields += config_fields(value, f"{prefix}{name}.") if len(value) else [(prefix + name, {})]
        else:
            fields.append((prefix + name, value))
    return fields


def run_job(main, define_flags):
    """Runs a job from the command line: `define_flags()` defines its flags and returns them (a dict of name to
    flag holder), absl parses the command line, then `main(flags)` runs with them as attributes.

    Called from a job's `if __name__ == "__main__":` block only, so that no
    flag is defined when a job is imported.  Positional arguments are refused.
    """
    try:
        # --config.FIELD overrides are checked against the config as the flags are defined.
        job_flags = types.SimpleNamespace(**define_flags())
    except (AttributeError, KeyError, ValueError, TypeError) as error:
        _refuse_arguments(error)
    for holder in vars(job_flags).values():
        # --help lists the program's own flags: these, wherever they were defined (--config and --workdir here).
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[holder.name])
    if any(argument in ("--help", "-h", "-?", "--helpshort") for argument in sys.argv[1:]):
        print(help_text(main, job_flags))
        sys.exit(0)

    def absl_main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        try:
            main(job_flags)
        except Stopped as stopped:
            sys.stderr.write(f"{stopped}\n")
            exit_now(stopped.exit_code)
        except (ValueError, FileNotFoundError, app.UsageError) as error:
            if os.environ.get("KERAS_VIT_TRACEBACK"):
                raise
            sys.stderr.write(f"Error: {error}\n")
            sys.exit(USER_ERROR_EXIT)
        except KeyboardInterrupt:  # Outside `fit`, which saves its state on SIGINT itself.
            sys.stderr.write("Interrupted.\n")
            sys.exit(130)

    app.run(absl_main, flags_parser=parse_flags)


def exit_now(code):
    """Ends the process with `code` once the exit handlers (`atexit`: JAX's distributed shutdown, absl's logs)
    have run and the output is flushed, without the interpreter's teardown: what the stopped job still holds
    is not deleted, and the deletion of an input iterator can wait up to a minute on tf.data's autotuning
    thread, past a platform's grace period."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def parse_flags(argv):
    """absl's parsing of the command line, with a wrong flag or config field told in one message (and a
    pointer to `--config.FIELD` for a flag that is a config field) and exit status 2, not a traceback."""
    try:
        remaining = flags.FLAGS(argv)
        if "config" in flags.FLAGS:
            flags.FLAGS.config  # noqa: B018 (the --config.FIELD overrides are applied when it is read)
        return remaining
    except flags.UnrecognizedFlagError as error:
        hint = ""
        if "config" in flags.FLAGS and error.flagname in flags.FLAGS["config"].default:
            hint = f" The config field is set with --config.{error.flagname}=VALUE."
        message = f"Unknown flag --{error.flagname}.{hint}"
    except Exception as error:  # Parsing and config overrides raise several types; all mean a bad argument.
        _refuse_arguments(error)
    _refuse_arguments(message)


def _refuse_arguments(error):
    """Writes what is wrong with the command line (an exception or a message) and exits with status 2."""
    message = error
    if not isinstance(error, str):
        while error.args and isinstance(error.args[0], BaseException):  # config_flags wraps a KeyError.
            error = error.args[0]
        text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
        first, _, rest = text.strip().partition("\n")
        if isinstance(error, (AttributeError, KeyError)):  # A --config.FIELD the config does not have.
            message = f"Unknown config field {first}." + (f" {rest.strip()}" if rest else "")
        else:
            message = " ".join(text.split())
    sys.stderr.write(f"Error: {message}\nRun with --help for the flags and the config fields.\n")
    sys.exit(USER_ERROR_EXIT)


class Phases:
    """Wall-clock seconds of the job's phases, in the order they ran: `--profile_phases` prints them as a
    table, to see what a run spends outside its training steps."""

    def __init__(self):
        self.seconds = {}

    def add(self, name, seconds):
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    @contextlib.contextmanager
    def timing(self, name):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add_fit(self, seconds, throughput):
        """`fit`'s `seconds`, split by `throughput` (`keras_vit.callbacks.Throughput`) into the first training
        step (tracing and compiling), the other steps, the validation and the rest."""
        first, steps = throughput.step_seconds()
        self.add("training: first step (tracing, compiling)", first)
        self.add("training: the other steps", steps)
        self.add("validation in fit", throughput.validation_seconds)
        self.add("fit: the rest (starting the input, epoch ends: logs, best.keras, figures)",
                 seconds - first - steps - throughput.validation_seconds)  # fmt: skip

    def table(self):
        """The phases, their seconds and shares, the total and what lies outside the training steps."""
        total = sum(self.seconds.values())
        rows = [f"{'phase':<76} {'seconds':>8} {'share':>6}"]
        rows += [f"{name:<76} {seconds:8.2f} {seconds / total:6.1%}" for name, seconds in self.seconds.items()]
        outside = total - self.seconds.get("training: the other steps", 0.0)
        rows.append(f"{'total':<76} {total:8.2f}")
        rows.append(f"{'outside the training steps':<76} {outside:8.2f} {outside / total:6.1%}")
        return "\n".join(rows)


def process_seconds():
    """Wall-clock seconds since this process started (Linux: /proc); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started / os.sysconf("SC_CLK_TCK")
