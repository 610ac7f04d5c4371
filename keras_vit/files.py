"""Files written whole or not at all: every file and folder the library and the jobs write goes through here.

`atomic_path(path)` yields a temporary local path to write to; when the block completes, what was written there
replaces `path`, and only then.  A failure inside the block (an exception, a full disk, a quota) leaves `path` as
it was (the previous file or folder, byte for byte, or nothing) and removes the temporary.  As Orbax's
checkpointer does with a temporary folder, and as `os.replace` was made for.

What is guaranteed, by where `path` is:

- A local path (or file://): the temporary lies beside `path` (same folder, so same file system), named
  `.<name>.tmp-<random>`; a file is flushed to disk (fsync), given the mode of the file it replaces, and renamed
  onto `path` by one POSIX rename, which is atomic: a reader sees the old file or the new one, never a mix, even
  if the process is killed.  A folder (a SavedModel) replaces an existing one in three renames: the old one aside
  (`.<name>.old-<random>`), the new one in, the old one deleted; a process killed between the first two leaves
  the old folder under the aside name.
- Any other TensorFlow file system (gs://, ram://, ...): the block writes to a local temporary (`tempfile`), which
  is then copied to `.<name>.tmp-<random>` beside `path` and renamed onto it with `tf.io.gfile`.  Object stores
  have no atomic rename (a rename there is a copy and a delete, file by file for a folder), but nothing partial
  ever appears under the final name because of a failed write: the copy fails before the rename.

A process killed mid-write can leave a temporary behind (hidden by its leading dot); it never takes the place of
the destination.  TensorFlow is imported only for paths that are not local.
"""

import contextlib
import os
import posixpath
import shutil
import stat
import tempfile
import uuid

__all__ = ["atomic_path", "write_bytes_atomically", "write_text_atomically"]


def is_local(path):
    """Whether `path` is on the local file system: no scheme, or file://."""
    return "://" not in path or path.startswith("file://")


def sibling(path, kind):
    """A hidden name beside `path` for a temporary of `kind` ("tmp", "old"): `<folder>/.<name>.<kind>-<random>`."""
    split = os.path.split if is_local(path) else posixpath.split
    folder, name = split(path.rstrip("/"))
    hidden = f".{name}.{kind}-{uuid.uuid4().hex[:12]}"
    return os.path.join(folder, hidden) if is_local(path) else posixpath.join(folder, hidden)


@contextlib.contextmanager
def atomic_path(path, *, suffix=""):
    """Yields a local path to write a file or a folder to; it replaces `path` when the block completes.

    `path`: the destination (str or path-like; local, gs:// or any TensorFlow file system).  `suffix` ends the
    temporary's name, for writers that insert on one (`suffix=".keras"` for `model.save`).  Whatever the block
    creates under the temporary path (a file, or a folder) replaces `path`; if it creates nothing, `path` is left
    as it was.  An exception inside the block, or while moving the result into place, propagates, and leaves
    `path` as it was and no temporary behind.  The folder of `path` is not created here (writers that create it
    still do so).  See the module's docstring for what is guaranteed on each kind of file system.
    """
    path = os.fspath(path)
    if is_local(path):
        destination = path[len("file://"):] if path.startswith("file://") else path
        temporary = sibling(destination, "tmp") + suffix
        try:
            yield temporary
            if os.path.lexists(temporary):
                _replace_local(temporary, destination)
        finally:
            _remove_local(temporary)
        return
    staging = tempfile.mkdtemp(prefix="keras_vit-")
    try:
        local = os.path.join(staging, posixpath.basename(path.rstrip("/")) + suffix)
        yield local
        if os.path.lexists(local):
            _publish_remote(local, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_bytes_atomically(path, data):
    """Writes `data` (bytes) to `path` (local, gs:// or any TensorFlow file system) with `atomic_path`; returns
    `path` as a string."""
    with atomic_path(path) as temporary, open(temporary, "wb") as f:
        f.write(data)
    return os.fspath(path)


def write_text_atomically(path, text):
    """Writes `text` as UTF-8 to `path` (local, gs:// or any TensorFlow file system) with `atomic_path`; returns
    `path` as a string."""
    return write_bytes_atomically(path, text.encode("utf-8"))


# === Local ===


def _remove_local(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _sync_local(path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _replace_local(new, path):
    """Moves `new` onto `path`: one atomic rename for a file onto a file, else the old one aside first."""
    if not os.path.isdir(new) and not os.path.isdir(path):
        if os.path.exists(path):  # The file keeps its mode; a new one gets the umask's.
            os.chmod(new, stat.S_IMODE(os.stat(path).st_mode))
        _sync_local(new)
        os.replace(new, path)
        return
    old = None
    if os.path.lexists(path):
        old = sibling(path, "old")
        os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    if old is not None:
        _remove_local(old)


# === Other file systems, through tf.io.gfile ===


def _publish_remote(local, path):
    """Copies the local file or folder `local` beside `path`, then moves it onto `path`."""
    import tensorflow as tf

    gfile = tf.io.gfile
    temporary = sibling(path, "tmp")
    try:
        if os.path.isdir(local):
            for folder, _, names in os.walk(local):
                relative = os.path.relpath(folder, local)
                target = temporary if relative == "." else posixpath.join(temporary, *relative.split(os.sep))
                gfile.makedirs(target)
                for name in names:
                    gfile.copy(os.path.join(folder, name), posixpath.join(target, name), overwrite=True)
        else:
            gfile.copy(local, temporary, overwrite=True)
        if not gfile.isdir(path) and not gfile.isdir(temporary):
            gfile.rename(temporary, path, overwrite=True)
            return
        old = None
        if gfile.exists(path):
            old = sibling(path, "old")
            _move_remote(path, old)
        try:
            _move_remote(temporary, path)
        except BaseException:
            if old is not None:
                _move_remote(old, path)
            raise
        if old is not None:
            _remove_remote(old)
    finally:
        if gfile.exists(temporary):
            _remove_remote(temporary)


def _move_remote(source, destination):
    import tensorflow as tf

    gfile = tf.io.gfile
    if not gfile.isdir(source):
        gfile.rename(source, destination, overwrite=True)
        return
    # A folder moved file by file: a folder rename is not supported by every file system (ram:// moves none of
    # its files); on object stores it is a copy and a delete per file anyway.
    for folder, _, names in gfile.walk(source):
        target = destination + folder[len(source):]
        gfile.makedirs(target)
        for name in names:
            gfile.rename(posixpath.join(folder, name), posixpath.join(target, name), overwrite=True)
    _remove_remote(source)


def _remove_remote(path):
    import tensorflow as tf

    if tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
    else:
        tf.io.gfile.remove(path)
