"""Native CPU kernels for TensorFlow, compiled on first use.

`attention_ops()` returns the op library of `attention_ops.cc` (ops
`KerasVitAttention` and `KerasVitAttentionGrad`, with CPU kernels and XLA CPU
kernels; see `attention.h` for what they compute), or None where it cannot be
had: no C++ compiler, a TensorFlow without the headers or libraries the build
needs, a build or load error (logged once, with the compiler's message), or
`KERAS_VIT_NATIVE=0` in the environment. Callers fall back to TensorFlow ops.

The library is built against the installed TensorFlow (`tf.sysconfig`) for
the CPU it runs on (AVX-512 or AVX2 code where the CPU has it) and cached
under `$KERAS_VIT_CACHE` (default `~/.cache/keras_vit`) in a directory named
by a hash of the sources, the TensorFlow version and build, the compiler and
the flags, so a change of any of them builds anew (and the same TensorFlow
wheel installed elsewhere reuses the build). Processes that start together
take turns (a file lock); a failed build is remembered in the same directory
and reported by later calls until `build(force=True)`. The build writes to a temporary name
and renames, so concurrent processes never load a half-written library.
Building takes about a minute on two cores (both sources compile in parallel).
"""

import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = ("attention_ops.cc", "attention_ffi.cc")
_HEADERS = ("attention.h",)
_LIBRARY = "keras_vit_attention.so"
_FAILURE = "build-error.txt"

logger = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """The native library could not be compiled or loaded."""


def cache_dir():
    """Where built libraries are kept: $KERAS_VIT_CACHE/native, default ~/.cache/keras_vit/native."""
    root = os.environ.get("KERAS_VIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "keras_vit")
    return os.path.join(root, "native")


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _arch_flags(cpu_flags):
    """Vector extensions to compile for: those of this CPU that the kernels use.

    Named one by one rather than -march=native, which on recent CPUs also turns
    on AVX512-FP16, whose Eigen code in TensorFlow's headers GCC 12 rejects.
    """
    avx512 = ("avx512f", "avx512vl", "avx512bw", "avx512dq")
    if all(flag in cpu_flags for flag in avx512) and "fma" in cpu_flags:
        return ["-mavx2", "-mfma", "-mf16c"] + [f"-m{flag}" for flag in avx512]
    if {"avx2", "fma"} <= cpu_flags:
        return ["-mavx2", "-mfma"] + (["-mf16c"] if "f16c" in cpu_flags else [])
    return []


def _compiler():
    """The C++ compiler's command as a list ($CXX may carry arguments, e.g. `ccache g++`), or None."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    return [found] if found else None


def _tf_dir(tf):
    """The installed TensorFlow package's directory, which holds its libraries."""
    return os.path.dirname(tf.sysconfig.get_lib() + os.sep)


def _build_commands(compiler, tf, out_dir):
    """[(command, output)]: one compile per source, then the link."""
    include = tf.sysconfig.get_include()
    compile_flags = tf.sysconfig.get_compile_flags() + [
        # Headers XLA's include chain reaches that the wheel ships outside include/'s root.
        f"-I{os.path.join(include, 'external', 'highwayhash')}",
        f"-I{os.path.join(include, 'external', 'farmhash_archive', 'src')}",
        "-O3",
        "-DNDEBUG",
        "-fPIC",
        "-fvisibility=hidden",
        "-w",
        *_arch_flags(_cpu_flags()),
    ]
    tf_dir = _tf_dir(tf)
    objects, commands = [], []
    for source in _SOURCES:
        obj = os.path.join(out_dir, source.replace(".cc", ".o"))
        commands.append(([*compiler, *compile_flags, "-c", os.path.join(_HERE, source), "-o", obj], obj))
        objects.append(obj)
    library = os.path.join(out_dir, _LIBRARY)
    link = [
        *compiler,
        "-shared",
        *objects,
        "-o",
        library,
        *tf.sysconfig.get_link_flags(),
        # The XLA kernel classes live in libtensorflow_cc, which TensorFlow's Python module has loaded.
        "-l:libtensorflow_cc.so.2",
        f"-Wl,-rpath,{tf_dir}",
    ]
    commands.append((link, library))
    return commands


def _build_key(compiler, tf):
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_HERE, name), "rb") as f:
            digest.update(f.read())
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True).stdout
    except OSError as error:
        raise BuildError(f"Cannot run the C++ compiler {' '.join(compiler)!r}: {error}") from error
    # The same TensorFlow wheel in another environment (a fresh virtualenv, another clone) shares the
    # build: its location is left out, its version, build and library size are in.
    tf_dir = _tf_dir(tf)
    commands = [
        [part.replace(tf_dir, "TF").replace(_HERE, "SRC") for part in c] for c, _ in _build_commands(compiler, tf, "OUT")
    ]
    framework = os.path.join(tf_dir, "libtensorflow_framework.so.2")
    size = os.path.getsize(framework) if os.path.exists(framework) else None
    build_info = sorted((k, str(v)) for k, v in tf.sysconfig.get_build_info().items())
    digest.update(repr((tf.__version__, build_info, size, version, commands)).encode())
    return digest.hexdigest()[:16]


def _check(command, output, returncode):
    if returncode != 0:
        raise BuildError(f"`{' '.join(command)}` failed with exit code {returncode}:\n{output[-4000:]}")


def build(force=False):
    """Compiles the op library if it is not in the cache; returns its path. Raises BuildError."""
    import tensorflow as tf

    compiler = _compiler()
    if compiler is None:
        raise BuildError("No C++ compiler found (looked for $CXX, g++, c++, clang++).")
    if not os.path.isdir(os.path.join(tf.sysconfig.get_include(), "tensorflow", "compiler", "tf2xla")):
        raise BuildError(f"TensorFlow {tf.__version__} ships no tf2xla headers under {tf.sysconfig.get_include()}.")
    target_dir = os.path.join(cache_dir(), _build_key(compiler, tf))
    library = os.path.join(target_dir, _LIBRARY)
    failure = os.path.join(target_dir, _FAILURE)
    if os.path.exists(library) and not force:
        return library
    os.makedirs(target_dir, exist_ok=True)
    # One build at a time per target (processes started together wait for the first); a failed
    # build is remembered, so later processes report it instead of compiling again.
    with open(os.path.join(target_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(library) and not force:
            return library
        if os.path.exists(failure) and not force:
            with open(failure) as f:
                raise BuildError(f"An earlier build failed (build(force=True) retries; {failure}):\n{f.read()}")
        try:
            _compile(compiler, tf, target_dir, library)
        except BuildError as error:
            with open(failure, "w") as f:
                f.write(str(error))
            raise
        if os.path.exists(failure):
            os.remove(failure)
    return library


def _compile(compiler, tf, target_dir, library):
    with tempfile.TemporaryDirectory(dir=target_dir) as work:
        *compiles, link = _build_commands(compiler, tf, work)
        logger.info("Compiling keras_vit's native attention kernels into %s (about a minute)", target_dir)
        # The sources compile in parallel, then link.
        running = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c, _ in compiles]
        outputs = [process.communicate()[0] for process in running]
        for process, output in zip(running, outputs):
            _check(process.args, output, process.returncode)
        linked = subprocess.run(link[0], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _check(linked.args, linked.stdout, linked.returncode)
        os.replace(link[1], library)


@functools.lru_cache(maxsize=None)
def attention_ops():
    """The loaded op library, or None (see the module docstring)."""
    if os.environ.get("KERAS_VIT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    import tensorflow as tf

    try:
        library = build()
        return tf.load_op_library(library)
    except Exception as error:  # noqa: BLE001 - any failure means the TensorFlow-op fallback
        logger.warning("keras_vit's native attention kernels are not available, using TensorFlow ops: %s", error)
        return None
