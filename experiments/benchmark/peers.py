r"""Other ViT implementations, built with the same architecture, for the benchmark.

- keras-hub: `keras_hub.models.ViTImageClassifier` on a `ViTBackbone`, run
  in-process with Keras `predict` / `fit` like ours.
- timm: `timm.models.vision_transformer.VisionTransformer` (PyTorch, with
  `scaled_dot_product_attention`), run in a child process
  (`python -m experiments.benchmark.peers --timm ...`): TensorFlow and PyTorch in one
  process crash on this machine when building a B/16. The parent sends
  "<steps>\n" on stdin, the child runs that many batches and answers with the
  seconds taken, so repetitions still interleave with the other
  implementations. Two forms: eager, and compiled as a PyTorch user trains and
  serves on a GPU (`compiled=True`): `torch.compile` of the whole training
  step (forward, backward and a fused AdamW update) or of the model.
  Precision: bfloat16 autocast for mixed_bfloat16; for float32 on CUDA both
  forms allow TF32 matmuls and convolutions, as XLA does on GPUs by default.

Neither is a dependency of keras_vit: `pip install -e ".[bench]"` installs
them (see README, Performance).
"""

import importlib.util
import os
import subprocess
import sys
import time

import numpy as np

# The peers `--compare` takes, and the package each needs (the `bench` extra).
PEERS = {"keras_hub": ("keras_hub", "keras-hub"), "timm": ("timm", "timm"), "timm_compiled": ("timm", "timm")}

MISSING = (
    "{package} is not installed; the comparison needs the optional `bench` extra: "
    "pip install -e \".[bench]\" (see README, Performance)."
)


def require(module, package):
    """Exits naming the package to install when `module` is not installed.

    Looks the module up without importing it: importing PyTorch into the
    benchmark's TensorFlow process is what crashes (see above).
    """
    if importlib.util.find_spec(module) is None:
        raise SystemExit(MISSING.format(package=package))


def check_compare(compare, timm_python=None):
    """Exits naming what is wrong with the peers of `--compare`: a name that is none of `PEERS`, or a
    peer whose package is not installed (timm's is looked for only when it runs in this interpreter)."""
    unknown = sorted(set(compare) - set(PEERS))
    if unknown:
        raise SystemExit(f"--compare takes a subset of {list(PEERS)}. Received: {unknown}")
    for peer in compare:
        module, package = PEERS[peer]
        if module == "keras_hub" or timm_python is None:
            require(module, package)


def keras_hub_model(config, image_size, num_classes, precision):
    """keras-hub's ViT classifier with `config`'s architecture."""
    require("keras_hub", "keras-hub")
    import keras
    import keras_hub

    if config.resnet_layers is not None or config.patch_size[0] != config.patch_size[1]:
        raise SystemExit("keras-hub's ViT has no hybrid and no non-square patches.")
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(image_size, image_size, 3),
        patch_size=config.patch_size[0],
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        hidden_dim=config.hidden_dim,
        mlp_dim=config.mlp_dim,
        dtype=precision,
    )
    classifier = keras_hub.models.ViTImageClassifier(
        backbone=backbone, num_classes=num_classes, dtype=precision
    )
    if keras.backend.backend() == "tensorflow":
        return classifier
    # keras-hub's `predict` and `fit` build a tf.data or Grain pipeline even
    # without a preprocessor; elsewhere its layers, as a functional Model, run
    # under the same Keras loop as ours.
    return keras.Model(classifier.inputs, classifier.outputs)


class TimmWorker:
    """A timm ViT in a child process, driven one round of batches at a time."""

    def __init__(
        self, config, image_size, batch_size, num_classes, mode, precision, device="cpu", compiled=False, python=None,
        passive_threads=False,
    ):  # fmt: skip
        args = timm_args(config, image_size, batch_size, num_classes, mode, precision, device, python) + [
            "--compile"
        ] * bool(compiled)
        env = None
        if passive_threads:
            # Two PyTorch processes on the same cores: OpenMP threads that spin-wait after
            # their round slow the other's round (a 7x slower tiny model was seen on 2 cores).
            env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        self.process = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env
        )
        self.parameters = int(self._read())
        self.versions = read_versions(self._read())  # Of the interpreter that runs the worker.

    def _read(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"The timm worker exited with status {self.process.wait()}.")
        return line.strip()

    def __call__(self, steps):
        self.process.stdin.write(f"{steps}\n")
        return float(self._read())

    def close(self):
        self.process.stdin.close()
        self.process.wait()


# === The child process ===


def _worker_arguments(argv):
    import argparse

    parser = argparse.ArgumentParser(description="The benchmark's timm worker.")
    parser.add_argument("--timm", action="store_true", required=True)
    for name in ("hidden_dim", "num_layers", "num_heads", "mlp_dim", "patch_size", "image_size",
                 "batch_size", "num_classes"):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--mode", choices=("infer", "train"), required=True)
    parser.add_argument("--precision", choices=("float32", "mixed_bfloat16"), required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile the step (or the model).")
    parser.add_argument("--onnx", help="Export the model (eval mode, float32, any batch) to this ONNX file and exit.")
    return parser.parse_args(argv)


def timm_args(config, image_size, batch_size, num_classes, mode, precision, device="cpu", python=None):
    """The command line of the timm worker for a plain ViT of `config`; exits naming what is missing first."""
    if config.resnet_layers is not None:
        raise SystemExit("The timm comparison covers plain ViTs only, not hybrids.")
    if python is None:  # Another interpreter checks its own packages, in the child.
        require("timm", "timm")  # A clear error here rather than in the child.
    return [
        python or sys.executable, "-m", "experiments.benchmark.peers", "--timm",
        f"--hidden_dim={config.hidden_dim}", f"--num_layers={config.num_layers}",
        f"--num_heads={config.num_heads}", f"--mlp_dim={config.mlp_dim}",
        f"--patch_size={config.patch_size[0]}", f"--image_size={image_size}",
        f"--batch_size={batch_size}", f"--num_classes={num_classes}",
        f"--mode={mode}", f"--precision={precision}", f"--device={device}",
    ]  # fmt: skip


def export_timm_onnx(config, image_size, num_classes, path, python=None):
    """timm's ViT of `config` (its own initial weights) exported by `torch.onnx.export` to `path`, in a child
    process: input `images` (batch, 3, height, width) float32 normalized pixels, output `logits`. Returns
    {"timm": version, "torch": version} of the interpreter that exported it."""
    args = timm_args(config, image_size, 1, num_classes, "infer", "float32", python=python)
    done = subprocess.run([*args, f"--onnx={path}"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"timm's ONNX export exited with status {done.returncode}: {done.stderr[-2000:]}")
    return read_versions(done.stdout.strip().splitlines()[-1])


def versions_line(timm, torch):
    """The line the worker prints to say what runs it: "timm=VERSION torch=VERSION"."""
    return f"timm={timm.__version__} torch={torch.__version__}"


def read_versions(line):
    """{"timm": version, "torch": version} of a `versions_line`."""
    return dict(item.split("=", 1) for item in line.split())


def timm_worker(argv):
    import timm
    import torch
    from timm.models.vision_transformer import VisionTransformer

    f = _worker_arguments(argv)
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    if f.device == "cuda" and f.precision == "float32":  # TF32, as XLA's default on GPUs.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = VisionTransformer(
        img_size=f.image_size,
        patch_size=f.patch_size,
        embed_dim=f.hidden_dim,
        depth=f.num_layers,
        num_heads=f.num_heads,
        mlp_ratio=f.mlp_dim / f.hidden_dim,
        num_classes=f.num_classes,
    ).to(f.device)
    rng = np.random.default_rng(0)
    images = torch.from_numpy(
        rng.uniform(-1, 1, (f.batch_size, 3, f.image_size, f.image_size)).astype(np.float32)
    ).to(f.device)
    labels = torch.from_numpy(rng.integers(0, f.num_classes, f.batch_size)).to(f.device)
    if f.onnx:
        torch.onnx.export(
            model.eval(), (images,), f.onnx, input_names=["images"], output_names=["logits"],
            dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False,
        )  # fmt: skip
        print(versions_line(timm, torch), flush=True)
        return
    autocast = torch.autocast(f.device, dtype=torch.bfloat16, enabled=f.precision == "mixed_bfloat16")

    def synchronize():  # CUDA kernels run asynchronously: a timing waits for them.
        if f.device == "cuda":
            torch.cuda.synchronize()

    if f.mode == "train":
        model.train()
        # The fused (one kernel) update on CUDA for the compiled form; eager keeps PyTorch's default.
        fused = f.compile and f.device == "cuda"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step():
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = loss_fn(model(images), labels)
            loss.backward()
            optimizer.step()

        if f.compile:
            step = torch.compile(step)
    else:
        model.eval()
        forward = torch.compile(model) if f.compile else model

        def step():
            with torch.inference_mode(), autocast:
                forward(images)

    for _ in range(3 if f.compile else 0):  # Compilation (and recompilation once AdamW has state) before timing.
        step()
    synchronize()
    print(sum(p.numel() for p in model.parameters()), flush=True)
    print(versions_line(timm, torch), flush=True)
    for line in sys.stdin:
        steps = int(line)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize()
        print(time.perf_counter() - start, flush=True)


if __name__ == "__main__":
    timm_worker(sys.argv[1:])
