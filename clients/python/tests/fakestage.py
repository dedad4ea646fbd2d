"""A small in-process stand-in for sluice-stage, for the client's unit tests.

It speaks the protocol of docs/protocol.md over a UNIX socket, one thread per
connection, with no prefetching: enough to test the client's request/response
logic, error mapping and plan iteration without the Rust binary. The real
stage is tested in test_stage_e2e.py.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from sluice import plan as splan
from sluice import protocol as p


def _listing(root):
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            full = os.path.join(dirpath, f)
            if os.path.isfile(full):
                out.append((os.path.relpath(full, root).replace(os.sep, "/"), os.path.getsize(full)))
    out.sort(key=lambda e: e[0].encode())
    return out


def _digest(files):
    h = 0xCBF29CE484222325
    for name, size in files:
        for b in name.encode() + b"\x00" + struct.pack(">Q", size):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class FakeStage:
    """Serves ``datasets`` (name -> directory) on ``path`` until closed.

    ``script`` optionally maps a request type to a callable returning raw
    bytes to send instead of the normal answer (to test bad responses),
    ``(bytes, True)`` to close the connection after sending them, or None to
    answer normally. ``next_delay`` seconds pass before each ``NEXT`` answer.
    ``requests`` records the type of every request received, in order.
    """

    def __init__(self, path, datasets, max_response_frame=p.MAX_RESPONSE_FRAME, script=None,
                 next_delay=0.0, versions=(1, 2)):
        self.path = path
        # Protocol versions spoken (it never grants shared memory).
        self.versions = versions
        self.datasets = datasets
        self.max_response_frame = max_response_frame
        self.script = script or {}
        self.next_delay = next_delay
        self.requests = []
        self.plan_runs = []  # the run each PLAN named (0: none)
        self.plans = {}  # (job, rank, epoch) -> dict
        self.lock = threading.Lock()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def close(self):
        self.sock.close()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        state = {"hello": None, "ds": None, "plan": None}
        f = conn.makefile("rb")
        try:
            while True:
                head = f.read(5)
                if len(head) < 5:
                    return
                length, t = struct.unpack(">IB", head)
                if length > p.MAX_REQUEST_FRAME:
                    conn.sendall(p.encode_error(2, "frame too large", True))
                    return
                payload = f.read(length - 1)
                self.requests.append(t)
                if t in self.script:
                    out = self.script[t]()
                    if out is not None:
                        close = isinstance(out, tuple)
                        conn.sendall(out[0] if close else out)
                        if close:
                            return
                        continue
                if t == p.MsgType.NEXT and self.next_delay:
                    time.sleep(self.next_delay)
                try:
                    msg = p.decode_request(t, payload)
                except p.FrameError as e:
                    conn.sendall(p.encode_error(1, str(e), True))
                    return
                out, done = self._handle(state, msg)
                conn.sendall(out)
                if done:
                    return
        finally:
            f.close()
            conn.close()

    def _handle(self, st, msg):
        if st["hello"] is None and not isinstance(msg, p.Hello):
            return p.encode_error(4, "expected HELLO first", True), True
        if isinstance(msg, p.Hello):
            if st["hello"] is not None:
                return p.encode_error(4, "second HELLO", True), True
            if msg.version not in self.versions:
                return p.encode_error(3, f"version {msg.version} unsupported", True), True
            if msg.rank >= msg.world_size:
                return p.encode_error(5, "rank >= world_size", False), False
            st["hello"] = msg
            return p.encode_welcome("fake", p.MAX_REQUEST_FRAME, self.max_response_frame,
                                    version=msg.version), False
        if isinstance(msg, p.Bye):
            return p.encode_goodbye(), True
        if isinstance(msg, p.Open):
            if msg.dataset not in self.datasets:
                return p.encode_error(10, f"no dataset named {msg.dataset!r}"), False
            root = self.datasets[msg.dataset]
            files = _listing(root)
            st["ds"] = (root, files, _digest(files))
            st["plan"] = None
            return p.encode_opened(len(files), sum(s for _, s in files), st["ds"][2]), False
        if st["ds"] is None:
            return p.encode_error(11, "no dataset open"), False
        root, files, digest = st["ds"]
        if isinstance(msg, p.ListFiles):
            return p.encode_files(len(files), files[msg.offset:msg.offset + msg.limit]), False
        if isinstance(msg, p.Read):
            if ".." in msg.name.split("/") or msg.name.startswith("/"):
                return p.encode_error(13, f"{msg.name!r} leaves the dataset root"), False
            try:
                with open(os.path.join(root, msg.name), "rb") as fh:
                    fh.seek(msg.offset)
                    data = fh.read(None if msg.length == p.READ_TO_END else msg.length)
            except FileNotFoundError:
                return p.encode_error(12, f"no such file: {msg.name}"), False
            if len(data) > self.max_response_frame - 16:
                return p.encode_error(18, "file too large for one frame"), False
            return p.encode_data(data), False
        if isinstance(msg, p.Fetch):
            samples = []
            for pos, name in enumerate(msg.names):
                try:
                    with open(os.path.join(root, name), "rb") as fh:
                        samples.append(p.Sample(pos, name, 0, fh.read()))
                except OSError as e:
                    samples.append(p.Sample(pos, name, 1, None, 12, f"{name}: {e.strerror}"))
            return p.encode_samples(False, samples), False
        if isinstance(msg, p.Plan):
            h = st["hello"]
            self.plan_runs.append(msg.run)
            if msg.kind == p.PlanKind.SHUFFLE:
                if (msg.file_count, msg.digest) != (len(files), digest):
                    return p.encode_error(15, "listing changed"), False
                names = [files[i][0] for i in splan.shuffle_plan(
                    len(files), msg.seed, msg.epoch, msg.shuffle, h.rank, h.world_size)]
            elif msg.kind == p.PlanKind.INDICES:
                if any(i >= len(files) for i in msg.indices):
                    return p.encode_error(15, "index out of range"), False
                names = [files[i][0] for i in msg.indices]
            else:
                names = list(msg.names)
            key = (h.job, h.rank, msg.epoch)
            with self.lock:
                existing = self.plans.get(key)
                if existing is None:
                    self.plans[key] = existing = {"names": names, "next": 0}
                    state = 0
                elif existing["names"] != names:
                    return p.encode_error(16, "a different plan is active"), False
                else:
                    state = 2 if existing["next"] >= len(names) else 1
            st["plan"] = (existing, root)
            return p.encode_planned(len(names), state), False
        if isinstance(msg, p.Next):
            if st["plan"] is None:
                return p.encode_error(17, "no plan"), False
            plan, root = st["plan"]
            with self.lock:
                start = plan["next"]
                end = min(start + msg.max_samples, len(plan["names"]))
                plan["next"] = end
            samples = []
            for pos in range(start, end):
                name = plan["names"][pos]
                try:
                    with open(os.path.join(root, name), "rb") as fh:
                        samples.append(p.Sample(pos, name, 0, fh.read()))
                except OSError as e:
                    samples.append(p.Sample(pos, name, 1, None, 14 if not isinstance(e, FileNotFoundError) else 12,
                                            f"{name}: {e.strerror}"))
            return p.encode_samples(end >= len(plan["names"]) and not samples, samples), False
        raise AssertionError(msg)
