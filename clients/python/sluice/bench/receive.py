"""Micro benchmark of the client's receive path (``python -m sluice.bench receive``).

A forked writer process streams prebuilt ``SAMPLES`` frames over a UNIX
socket pair; the reader parses them and this reports the reader's CPU time
per sample and the sample rate for two strategies:

- ``stream``: what the client uses (:func:`sluice.protocol.read_response`):
  fields and each sample's data are read straight off a buffered socket
  file, one ``f.read(n)`` per sample payload;
- ``frame``: the whole frame is read into a fresh ``bytearray`` with
  ``readinto`` and samples are sliced out of a ``memoryview`` (one copy
  each);
- ``frame-reuse``: the same, into one ``bytearray`` kept between frames.

Each measurement runs in a fresh interpreter, with and without the client's
malloc priming (:func:`sluice.client._prime_allocator`), because glibc's
heap trimming can cost more than the parsing itself.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from typing import List

from .. import protocol as p
from ..client import _prime_allocator
from .units import format_bytes, parse_bytes


class _FrameStrategy:
    """Reads a SAMPLES frame into one bytearray and slices the samples out.

    With ``reuse`` the bytearray is kept between frames (grown as needed),
    which saves allocating and faulting in fresh pages for every frame.
    """

    def __init__(self, reuse: bool) -> None:
        self.reuse = reuse
        self.buf = bytearray()

    def __call__(self, f) -> p.Samples:
        head = f.read(5)
        length, msg_type = struct.unpack(">IB", head)
        if msg_type != p.MsgType.SAMPLES:
            raise ValueError("expected SAMPLES")
        if self.reuse:
            if len(self.buf) < length - 1:
                self.buf = bytearray(length - 1)
            mv = memoryview(self.buf)[:length - 1]
        else:
            mv = memoryview(bytearray(length - 1))
        if f.readinto(mv) != len(mv):
            raise EOFError("truncated frame")
        return _parse(mv)


def _parse(mv: memoryview) -> p.Samples:
    buf = mv
    flags, count = struct.unpack_from(">BI", buf, 0)
    pos = 5
    out = []
    unpack_from = struct.unpack_from
    for _ in range(count):
        position, nlen = unpack_from(">IH", buf, pos)
        pos += 6
        name = bytes(mv[pos:pos + nlen]).decode()
        pos += nlen
        status = buf[pos]
        (n,) = unpack_from(">I", buf, pos + 1)
        pos += 5
        out.append(p.Sample(position, name, status, bytes(mv[pos:pos + n])))
        pos += n
    return p.Samples(bool(flags & 1), out)


STRATEGIES = ("stream", "frame", "frame-reuse")


def _writer(sock: socket.socket, frame: bytes, frames: int) -> None:
    try:
        for _ in range(frames):
            sock.sendall(frame)
    finally:
        sock.close()


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure(strategy: str, sample_size: int, per_frame: int, frames: int, buffering: int,
            prime: bool = True) -> dict:
    """Returns rate and CPU per sample for one strategy and buffer size.

    Call it in a fresh process: the allocator's state is part of what is
    measured (``prime`` applies the client's malloc priming first), so the
    frames are built in the forked writer, never in the reader.
    """
    if prime:
        _prime_allocator()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the writer
        a.close()
        try:
            data = os.urandom(sample_size)
            frame = p.encode_samples(False, [p.Sample(i, f"train/{i:08d}.jpg", 0, data)
                                             for i in range(per_frame)])
            _writer(b, frame, frames)
        finally:
            os._exit(0)
    b.close()
    f = a.makefile("rb", buffering=buffering)
    read = p.read_response if strategy == "stream" else _FrameStrategy(strategy == "frame-reuse")
    cpu0, t0 = _cpu(), time.perf_counter()
    n = 0
    for _ in range(frames):
        n += len(read(f).samples)
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    f.close()
    a.close()
    os.waitpid(pid, 0)
    return {
        "strategy": strategy,
        "buffering": buffering,
        "sample_size": sample_size,
        "samples_per_s": n / wall,
        "mib_per_s": n * sample_size / wall / 2**20,
        "cpu_us_per_sample": cpu / n * 1e6,
        "prime": prime,
    }


def _measure_in_subprocess(*args) -> dict:
    code = ("import json, sys; from sluice.bench.receive import measure; "
            f"print(json.dumps(measure(*{args!r})))")
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench receive", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100KiB,4KiB", help="sample sizes, comma separated (default 100KiB,4KiB)")
    ap.add_argument("--per-frame", type=int, default=32, help="samples per SAMPLES frame (default 32)")
    ap.add_argument("--total", default="2GiB", help="bytes to move per measurement (default 2GiB)")
    ap.add_argument("--buffering", default="256KiB,1MiB,4MiB", help="socket file buffer sizes")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="subset of " + ",".join(STRATEGIES))
    ap.add_argument("--prime", default="yes,no",
                    help="with and/or without the client's malloc priming (default yes,no)")
    args = ap.parse_args(argv)
    choices = {"yes": True, "no": False}
    primes = [choices.get(x.strip()) for x in args.prime.split(",")]
    strategies = [x.strip() for x in args.strategies.split(",")]
    if None in primes:
        raise SystemExit("error: --prime takes yes, no or yes,no")
    if not strategies or set(strategies) - set(STRATEGIES):
        raise SystemExit(f"error: --strategies: choose from {', '.join(STRATEGIES)}")
    try:
        sizes = [parse_bytes(x) for x in args.size.split(",")]
        buffers = [parse_bytes(x) for x in args.buffering.split(",")]
        total = parse_bytes(args.total)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if min(sizes + buffers) < 1 or args.per_frame < 1 or total < 1:
        raise SystemExit("error: --size, --buffering, --total and --per-frame must be at least 1")
    print(f"{'strategy':11} {'prime':5} {'buffer':>8} {'sample':>8} {'samples/s':>11} {'MiB/s':>8} "
          f"{'CPU us/sample':>14}")
    for size in sizes:
        frames = max(20, total // (size * args.per_frame))
        frames = max(1, min(frames, 200_000 // args.per_frame))
        runs = [(b, pr, st) for b in buffers for pr in primes for st in strategies]
        for buffering, prime, strategy in runs:
            r = _measure_in_subprocess(strategy, size, args.per_frame, frames, buffering, prime)
            print(f"{strategy:11} {'yes' if prime else 'no':5} {format_bytes(buffering):>8} "
                  f"{format_bytes(size):>8} {r['samples_per_s']:11.0f} {r['mib_per_s']:8.0f} "
                  f"{r['cpu_us_per_sample']:14.1f}")
    return 0
