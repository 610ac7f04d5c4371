"""Checkpoint files: .npz and .safetensors, read and written as dicts of NumPy arrays.

Paths go through `tf.io.gfile`, so local, `gs://` and `ram://` paths are alike. Nothing is unpickled: .npz
files are read with pickling disabled, .safetensors files with the `safetensors` package's NumPy API (no
PyTorch). The two formats are told apart by their contents, not by the suffix (`read_checkpoint`).
"""

import io
import zipfile

import numpy as np

from keras_vit.checkpoints.base import CheckpointError
from keras_vit.files import write_bytes_atomically

# === Bytes ===


def read_bytes(path):
    """The bytes of the file at `path` (local or gs:// path); FileNotFoundError if there is none."""
    import tensorflow as tf

    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"No checkpoint at {path!r}.")
    with tf.io.gfile.GFile(path, "rb") as f:
        return f.read()


def write_bytes(data, path):
    """Writes `data` to the file at `path` (local or gs:// path) whole or not at all
    (`keras_vit.files.atomic_path`): a failed write leaves the previous file as it was."""
    write_bytes_atomically(path, data)


# === .npz ===


def read_npz_bytes(data, path, other_format=None, max_bytes=None):
    """The arrays of an .npz file's bytes `data` (read from `path`, named in errors), pickling disabled.

    `other_format` describes what else the bytes were tried as, for the message when they are no zip archive.
    `max_bytes`: the most the arrays may take once decompressed; the sizes the archive declares are checked
    against it before anything is decompressed (a small file can declare gigabytes), and an archive of no
    array is refused.
    """
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise CheckpointError(
            f"{path!r} is not an .npz checkpoint (a zip archive of .npy arrays)"
            + (f" {other_format}" if other_format else "")
            + f"; read {len(data)} bytes starting {data[:8]!r}. A truncated download looks like this too."
        )
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(f"{path!r} is truncated or corrupt: {error}") from None
    if not entries:
        raise CheckpointError(f"{path!r} is an .npz archive of no array; expected a checkpoint's weights.")
    declared = sum(entry.file_size for entry in entries)
    if max_bytes is not None and declared > max_bytes:
        largest = max(entries, key=lambda entry: entry.file_size)
        raise CheckpointError(
            f"{path!r} ({len(data):,} bytes) declares {declared:,} bytes of arrays once decompressed "
            f"({largest.filename!r}: {largest.file_size:,}), more than a checkpoint of this model can hold "
            f"({max_bytes:,}); refused before decompressing."
        )
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except ValueError as error:
        if "allow_pickle" in str(error):
            raise CheckpointError(
                f"{path!r} holds a pickled Python object; checkpoints are read with pickling "
                "disabled, so it was refused (it was not executed)."
            ) from None
        raise CheckpointError(f"{path!r} is not a readable .npz checkpoint: {error}") from None
    except (zipfile.BadZipFile, EOFError, OSError) as error:
        raise CheckpointError(f"{path!r} is truncated or corrupt: {error}") from None


def read_npz(path):
    """Reads an .npz checkpoint (local or gs:// path) as a dict of arrays, pickling disabled."""
    return read_npz_bytes(read_bytes(path), path)


def write_npz(params, path):
    """Writes a dict of arrays as an .npz file (local or gs:// path)."""
    buffer = io.BytesIO()
    np.savez(buffer, **params)
    write_bytes(buffer.getvalue(), path)


# === .safetensors ===


def is_safetensors(data):
    """Whether `data` starts like a .safetensors file: a little-endian u64 header size, then a JSON object."""
    return len(data) > 8 and data[8:9] == b"{" and int.from_bytes(data[:8], "little") <= len(data) - 8


def read_safetensors(data, path):
    """The arrays of a .safetensors file's bytes `data` (read from `path`), with the `safetensors`
    package's NumPy API; bfloat16 arrays are widened to float32 (NumPy has no bfloat16)."""
    import safetensors
    import safetensors.numpy

    try:
        return safetensors.numpy.load(data)
    except KeyError:  # A dtype the NumPy API has no NumPy type for.
        pass
    except safetensors.SafetensorError as error:
        raise CheckpointError(f"{path!r} is truncated or corrupt: {error}") from None
    arrays = {}
    for key, view in safetensors.deserialize(data):
        if view["dtype"] != "BF16":
            raise CheckpointError(
                f"{path!r}: the array {key!r} has dtype {view['dtype']}; expected a float type (F64, F32, F16, BF16)."
            )
        bits = np.frombuffer(view["data"], dtype="<u2").astype(np.uint32) << 16
        arrays[key] = bits.view(np.float32).reshape(view["shape"])
    return arrays


def write_safetensors(arrays, path):
    """Writes a dict of arrays as a .safetensors file (local or gs:// path), marked as PyTorch's
    layout (metadata format "pt") as timm's files are."""
    import safetensors.numpy

    data = safetensors.numpy.save({k: np.ascontiguousarray(v) for k, v in arrays.items()}, metadata={"format": "pt"})
    write_bytes(data, path)


# === Either ===


SHARD_INDEX_SUFFIX = ".safetensors.index.json"


def read_sharded(index_path, max_bytes=None):
    """The arrays of a checkpoint sharded over several `.safetensors` files, as transformers and timm save
    large models: `index_path` (`model.safetensors.index.json`) maps each array's name to its shard
    (`{"weight_map": {name: "model-00001-of-00002.safetensors", ...}}`, the shards beside the index).  Every
    name is read from the shard the index gives; a shard that lacks one, holds one the index does not give
    it, or is missing is named.  `max_bytes` bounds each shard."""
    import json

    import tensorflow as tf

    try:
        index = json.loads(read_bytes(index_path))
    except ValueError as error:
        raise CheckpointError(f"{index_path!r} is not valid JSON: {error}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path!r} has no 'weight_map' (array name -> shard file); not a shard index.")
    folder = index_path.rsplit("/", 1)[0] if "/" in index_path else "."
    by_shard = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or "/" in shard or shard in (".", ".."):
            raise CheckpointError(f"{index_path!r}: the shard of {name!r} is {shard!r}; expected a file name.")
        by_shard.setdefault(shard, set()).add(name)
    arrays = {}
    for shard, names in sorted(by_shard.items()):
        path = tf.io.gfile.join(folder, shard)
        if not tf.io.gfile.exists(path):
            raise CheckpointError(f"{index_path!r} names the shard {shard!r}, which is not beside it.")
        found = read_checkpoint(path, max_bytes)
        if set(found) != names:
            missing, extra = sorted(names - set(found)), sorted(set(found) - names)
            raise CheckpointError(
                f"The shard {path!r} does not hold what {index_path!r} says: missing {missing[:5]}, not indexed "
                f"{extra[:5]}."
            )
        arrays.update(found)
    return arrays


def read_checkpoint(path, max_bytes=None):
    """Reads an .npz or .safetensors checkpoint (local or gs:// path, told apart by their contents)
    as a dict of arrays; nothing is unpickled.  A directory and an empty file are refused with their own
    messages; with `max_bytes`, a file, or the arrays an .npz declares, larger than that is refused before it
    is read or decompressed.  A shard index (`*.safetensors.index.json`) reads its shards (`read_sharded`)."""
    import tensorflow as tf

    if str(path).endswith(SHARD_INDEX_SUFFIX):
        return read_sharded(str(path), max_bytes)

    # One stat for a file (a round trip on gs://); a folder of an object store, a prefix, has none.
    try:
        stats = tf.io.gfile.stat(path)
    except tf.errors.NotFoundError:
        stats = None
    if (stats.is_directory if stats is not None else tf.io.gfile.isdir(path)):
        raise CheckpointError(f"{path!r} is a directory; expected a checkpoint file (.npz or .safetensors).")
    size = stats.length if stats is not None else None  # None: read_bytes names the missing file.
    if size == 0:
        raise CheckpointError(f"{path!r} is empty (0 bytes); expected a checkpoint file (.npz or .safetensors).")
    if max_bytes is not None and size is not None and size > max_bytes:
        raise CheckpointError(
            f"{path!r} is {size:,} bytes, more than a checkpoint of this model can hold ({max_bytes:,}); "
            "refused before reading it."
        )
    data = read_bytes(path)
    if is_safetensors(data):
        return read_safetensors(data, path)
    return read_npz_bytes(data, path, "nor a .safetensors file (a JSON header, then the arrays)", max_bytes)
