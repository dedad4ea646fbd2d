"""DLIO-shaped benchmark data sets: many files of random bytes, cold cache.

A data set lives in ``<dir>/data`` (the directory a stage serves) with a
``<dir>/manifest.json`` describing its shape; an existing data set with the
same shape is reused instead of rewritten. A benchmark rewrites only a
directory it made (``manifest.json`` or the ``.sluice-bench`` marker says
so): one holding other files (a user's own data set) is refused, never
emptied.
"""

from __future__ import annotations

import json
import os
import random
from typing import List, NamedTuple

__all__ = ["BenchDataset", "DatasetError", "prepare", "evict"]

_FILES_PER_DIR = 1000
_MANIFEST_VERSION = 1
_MARKER = ".sluice-bench"


class DatasetError(RuntimeError):
    """The data set's directory cannot be used (not ours, or not writable)."""


class BenchDataset(NamedTuple):
    """A generated data set: files sorted by name bytes (the stage's index order)."""

    dir: str
    root: str
    files: int
    size: int
    size_stdev: int
    names: List[str]
    sizes: List[int]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def paths(self) -> List[str]:
        return [os.path.join(self.root, n) for n in self.names]

    def describe(self) -> dict:
        return {"files": self.files, "size": self.size, "size_stdev": self.size_stdev,
                "total_bytes": self.total_bytes, "dir": self.root}


def _shape(files: int, size: int, size_stdev: int, seed: int) -> dict:
    return {"version": _MANIFEST_VERSION, "files": files, "size": size, "size_stdev": size_stdev, "seed": seed}


def _plan_sizes(files: int, size: int, size_stdev: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    if size_stdev <= 0:
        return [size] * files
    return [max(1, int(round(rng.gauss(size, size_stdev)))) for _ in range(files)]


def prepare(dir: str, files: int, size: int, size_stdev: int = 0, seed: int = 0, log=print) -> BenchDataset:
    """Returns the data set of this shape under ``dir``, writing it if needed."""
    if files < 1 or size < 1:
        raise ValueError(f"a data set needs --files >= 1 and --size >= 1 (got {files}, {size})")
    root = os.path.join(dir, "data")
    manifest_path = os.path.join(dir, "manifest.json")
    shape = _shape(files, size, size_stdev, seed)
    sizes = _plan_sizes(files, size, size_stdev, seed)
    names = [f"train/{i // _FILES_PER_DIR:04d}/sample_{i:08d}.bin" for i in range(files)]
    order = sorted(range(files), key=lambda i: names[i].encode())
    names = [names[i] for i in order]
    sizes = [sizes[i] for i in order]
    ds = BenchDataset(dir, root, files, size, size_stdev, names, sizes)
    if _matches(manifest_path, shape, ds):
        log(f"reusing the data set in {root} ({files} files, {ds.total_bytes / 2**20:.0f} MiB)")
        return ds
    _claim(dir, root, manifest_path)
    log(f"writing {files} files ({ds.total_bytes / 2**20:.0f} MiB) into {root} ...")
    try:
        if os.path.exists(manifest_path):
            os.remove(manifest_path)
        for name, n in zip(names, sizes):
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(os.urandom(n))
        _remove_strays(root, set(names))
        with open(manifest_path, "w") as f:
            json.dump(shape, f)
    except OSError as e:
        raise DatasetError(f"cannot write the data set into {root}: {e.strerror or e}") from None
    return ds


def _claim(dir: str, root: str, manifest_path: str) -> None:
    """Marks ``dir`` as a benchmark's before anything is written into it;
    refuses one that holds files no benchmark made."""
    marker = os.path.join(dir, _MARKER)
    if os.path.exists(dir) and not os.path.isdir(dir):
        raise DatasetError(f"--dir {dir} is not a directory")
    try:
        if not (os.path.exists(marker) or os.path.exists(manifest_path)):
            foreign = next((os.path.join(p, f) for p, _, fs in os.walk(root) for f in fs), None)
            if foreign is not None:
                raise DatasetError(
                    f"--dir {dir}: {root} holds files this benchmark did not write (such as {foreign}), "
                    "which writing the data set would replace or remove: give an empty directory, "
                    "or one a benchmark made")
        os.makedirs(dir, exist_ok=True)
        with open(marker, "w") as f:
            f.write("A sluice benchmark data set: the benchmarks rewrite what is under data/.\n")
    except OSError as e:
        raise DatasetError(f"--dir {dir}: {e.strerror or e}") from None


def _matches(manifest_path: str, shape: dict, ds: BenchDataset) -> bool:
    try:
        with open(manifest_path) as f:
            if json.load(f) != shape:
                return False
        for name, n in zip(ds.names, ds.sizes):
            if os.stat(os.path.join(ds.root, name)).st_size != n:
                return False
    except (OSError, ValueError):
        return False
    count = sum(len(fs) for _, _, fs in os.walk(ds.root))
    return count == ds.files


def _remove_strays(root: str, keep: set) -> None:
    """Removes files a data set of another shape left behind."""
    for dirpath, _dirs, fs in os.walk(root):
        for f in fs:
            full = os.path.join(dirpath, f)
            if os.path.relpath(full, root).replace(os.sep, "/") not in keep:
                os.remove(full)


def evict(paths: List[str]) -> None:
    """Drops every file from the page cache (fsync first: dirty pages stay).

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` works without root.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
