"""Where the ``prefetch`` benchmark's data set is read from: the directory
itself, the directory behind ``sluice-slowfs`` (``--latency``), or an
S3-compatible server (``s3s-fs``) behind ``sluice-slowhttp`` (``--store s3``,
with ``--latency`` on every request). Every loader, the stage included,
reads through the same harness with the same latency.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import tempfile
import time
from typing import Callable, Iterator, List, Optional

from .dataset import BenchDataset, evict
from .s3 import (ACCESS_KEY, SECRET_KEY, S3Reader, S3Server, SlowHttp, find_s3_server, find_slowhttp_binary,
                 store_etags)
from .slowfs import SlowFs, find_slowfs_binary

__all__ = ["Storage", "open_storage", "LIMIT_CONCURRENCY"]

# Reads in flight when the harness's own limit is measured.
LIMIT_CONCURRENCY = 256
# sluice-slowfs's threads: calls served at once (they wait out the latency
# in queues, so this bounds the source's I/O in flight, not the calls).
SLOWFS_THREADS = 64
BUCKET = "bench"


class Storage:
    """How loaders reach the data set: ``view`` (the data set with its root
    where loaders read it), ``read`` (sample index -> bytes) for stores that
    are not files, and ``stage_args`` for the stage."""

    def __init__(self, kind: str, latency_ms: float, view: BenchDataset,
                 read: Optional[Callable[[int], bytes]] = None, stage_args: Optional[List[str]] = None,
                 source: Optional[BenchDataset] = None) -> None:
        self.kind = kind
        self.latency_ms = latency_ms
        self.view = view
        # The data set as files on this machine, behind any harness.
        self.source = source or view
        self.stage_args = stage_args or []
        if read is None:
            paths = view.paths()

            def read(i: int) -> bytes:
                with open(paths[i], "rb", buffering=0) as f:
                    return f.read()
        self.read = read

    def describe(self) -> dict:
        return {"kind": self.kind, "latency_ms": self.latency_ms}

    def evict(self) -> None:
        """Drops the data set's files from the page cache: the files the
        store serves, whatever ``view`` names them (an ``s3://`` URL is not
        a file)."""
        evict(self.source.paths())

    def limit(self, seconds: float = 5.0, concurrency: int = LIMIT_CONCURRENCY) -> dict:
        """The harness's own rate: ``concurrency`` threads reading samples in
        turn for ``seconds`` (a Python load generator: at high rates it may be
        the bound itself, so the figure is a lower bound of the harness's)."""
        n = self.view.files
        counter = iter(range(1 << 62))
        stop = time.perf_counter() + seconds
        got = [0, 0]

        def work() -> None:
            while time.perf_counter() < stop:
                data = self.read(next(counter) % n)
                got[0] += 1
                got[1] += len(data)

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(work) for _ in range(concurrency)]:
                f.result()
        wall = time.perf_counter() - t0
        return {"loader": "limit", "concurrency": concurrency, "samples_per_s": got[0] / wall,
                "mib_per_s": got[1] / wall / 2**20, "samples": got[0], "wall_s": wall}


@contextlib.contextmanager
def open_storage(kind: str, latency: str, latency_ms: float, ds: BenchDataset, bin_dir: str,
                 repo: str) -> Iterator[Storage]:
    """Sets up the harness for ``kind`` (``dir`` or ``s3``) and ``latency``
    (``0ms``: the directory itself, no harness) and tears it down after."""
    if kind == "dir" and latency_ms == 0:
        yield Storage("dir", 0.0, ds)
        return
    with tempfile.TemporaryDirectory(prefix="sluice-bench-store-") as tmp:
        if kind == "dir":
            fs = SlowFs.start(find_slowfs_binary(bin_dir), ds.root, os.path.join(tmp, "mnt"),
                              latency=latency, threads=SLOWFS_THREADS)
            with fs:
                yield Storage("dir", latency_ms, ds._replace(root=fs.mountpoint), source=ds)
            return
        # s3s-fs serves each directory of its root as a bucket.
        os.makedirs(os.path.join(tmp, "s3"))
        os.symlink(os.path.abspath(ds.root), os.path.join(tmp, "s3", BUCKET))
        store_etags(os.path.join(tmp, "s3"), BUCKET, ds.names)
        server = S3Server.start(find_s3_server(repo), os.path.join(tmp, "s3"))
        with server, SlowHttp.start(find_slowhttp_binary(bin_dir), server.address, latency=latency) as proxy:
            os.environ.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
            reader = S3Reader(proxy.endpoint, BUCKET)
            names = ds.names

            def read(i: int) -> bytes:
                return reader.read(names[i])

            yield Storage("s3", latency_ms, ds._replace(root=f"s3://{BUCKET}"), read,
                          ["--s3-endpoint", proxy.endpoint], source=ds)
