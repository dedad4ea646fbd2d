"""The trainer protocol's frame codec (``docs/protocol.md``, version 2; a
version 1 stage is still spoken to).

A frame is ``u32 length`` (big-endian, counts the type byte and the payload),
``u8 type``, then the payload. Fields are big-endian; ``str`` is a ``u16``
length and UTF-8, ``bytes`` a ``u32`` length, ``map`` a ``u16`` count of
``str`` pairs.

This module has three parts:

- ``encode_*`` functions build complete frames (requests and, for tests and
  fakes, responses);
- :func:`decode_request` / :func:`decode_response` parse one payload into a
  message tuple, enforcing that every byte is consumed;
- :func:`read_response` reads one response frame from a buffered binary file
  (``sock.makefile("rb")``). It streams the two bulk messages (``SAMPLES``
  and ``DATA``) straight off the file so each sample's payload is copied once,
  from the socket buffer into the ``bytes`` object handed to the caller.

Nothing here touches sockets directly; the client owns the connection.
"""

from __future__ import annotations

import enum
import operator
import struct
from typing import BinaryIO, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from .errors import ConnectionClosedError, ErrorCode, ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_REQUEST_FRAME",
    "MAX_RESPONSE_FRAME",
    "MAX_SAMPLES_PER_NEXT",
    "MAX_LIST_LIMIT",
    "READ_TO_END",
    "MsgType",
    "PlanKind",
    "PlanState",
    "ErrorCode",
    "FrameError",
    # messages
    "Hello", "Open", "ListFiles", "Plan", "Next", "Read", "Bye", "Release", "Fetch", "HandOff", "Run",
    "Welcome", "Opened", "Files", "Planned", "Sample", "Samples", "Data",
    "Goodbye", "Error",
    # codec
    "encode_frame", "encode_hello", "encode_open", "encode_list",
    "encode_plan_indices", "encode_plan_names", "encode_plan_shuffle",
    "encode_next", "encode_read", "encode_bye", "encode_release", "encode_fetch", "encode_hand_off",
    "encode_run",
    "encode_welcome", "encode_opened", "encode_files", "encode_planned",
    "encode_samples", "encode_data", "encode_goodbye", "encode_error",
    "decode_request", "decode_response", "split_frame", "read_response",
]

#: The newest protocol version this client speaks (it falls back to 1 for
#: a stage that refuses it).
PROTOCOL_VERSION = 2
#: ``HELLO`` feature bit (version 2): samples in shared memory.
FEATURE_SHARED_MEMORY = 1
#: ``HELLO`` feature bit (version 2): ``PLAN`` may name the trainer's run.
FEATURE_RUNS = 2
#: ``HELLO`` feature bit (version 2): the connection may say ``RUN``, and its
#: reads by name then deliver only that run's plan entries.
FEATURE_RUN_READS = 4
#: ``HELLO`` feature bit (version 2, with shared memory): the process that
#: receives slots handed off says so with ``TAKE``; until then they are in
#: transit, and come back if never received.
FEATURE_TAKES = 8
#: Bit of ``PLAN``'s kind byte: a ``u64 run`` follows the plan.
PLAN_WITH_RUN = 0x80
#: Largest trainer -> stage frame (``length`` field), 16 MiB.
MAX_REQUEST_FRAME = 16 * 1024 * 1024
#: Largest stage -> trainer frame in version 1 (the stage announces its own).
MAX_RESPONSE_FRAME = 256 * 1024 * 1024
#: Bounds of ``NEXT``'s ``max_samples``.
MAX_SAMPLES_PER_NEXT = 4096
#: Bound of ``LIST``'s ``limit``.
MAX_LIST_LIMIT = 65536
#: ``READ`` length meaning "to the end of the file".
READ_TO_END = 0xFFFFFFFFFFFFFFFF


class MsgType(enum.IntEnum):
    """Frame types."""

    HELLO = 0x01
    OPEN = 0x02
    LIST = 0x03
    PLAN = 0x04
    NEXT = 0x05
    READ = 0x06
    BYE = 0x07
    RELEASE = 0x08
    FETCH = 0x09
    HAND_OFF = 0x0A
    RUN = 0x0B
    TAKE = 0x0C
    WELCOME = 0x81
    OPENED = 0x82
    FILES = 0x83
    PLANNED = 0x84
    SAMPLES = 0x85
    DATA = 0x86
    GOODBYE = 0x87
    ERROR = 0xEE


class PlanKind(enum.IntEnum):
    """``PLAN`` kinds."""

    INDICES = 0
    NAMES = 1
    SHUFFLE = 2


class PlanState(enum.IntEnum):
    """``PLANNED`` states."""

    CREATED = 0
    JOINED = 1
    COMPLETE = 2


SAMPLE_OK = 0
SAMPLE_ERROR = 1
#: On the wire only: the sample is in the shared-memory region (offset,
#: length); :func:`read_response` hands it over as ``SAMPLE_OK`` with a
#: view of the region as its data.
SAMPLE_SHARED = 2


class FrameError(ValueError):
    """A payload does not follow the protocol (raised by the decoders).

    The client turns it into :class:`sluice.ProtocolError`.
    """


# --------------------------------------------------------------------------
# Messages. Plain named tuples: cheap to build, easy to compare in tests.


class Hello(NamedTuple):
    version: int
    job: str
    labels: Dict[str, str]
    rank: int
    world_size: int
    features: int = 0


class Open(NamedTuple):
    dataset: str


class ListFiles(NamedTuple):
    offset: int
    limit: int


class Plan(NamedTuple):
    """A ``PLAN`` request; the fields that do not apply to ``kind`` are None."""

    epoch: int
    kind: int
    indices: Optional[Sequence[int]] = None
    names: Optional[Sequence[str]] = None
    seed: Optional[int] = None
    shuffle: Optional[bool] = None
    file_count: Optional[int] = None
    digest: Optional[int] = None
    run: int = 0


class Next(NamedTuple):
    max_samples: int


class Read(NamedTuple):
    name: str
    offset: int
    length: int


class Bye(NamedTuple):
    pass


class Release(NamedTuple):
    offsets: list


class Fetch(NamedTuple):
    names: list


class HandOff(NamedTuple):
    offsets: list


class Run(NamedTuple):
    run: int


class Welcome(NamedTuple):
    version: int
    stage_id: str
    max_request_frame: int
    max_response_frame: int
    features: int = 0
    region_bytes: int = 0


class Opened(NamedTuple):
    file_count: int
    total_bytes: int
    digest: int


class Files(NamedTuple):
    total: int
    entries: list  # of (name, size)


class Planned(NamedTuple):
    length: int
    state: int


class Sample(NamedTuple):
    """One entry of ``SAMPLES``: ``data`` for status 0 (bytes, or a view of
    the shared-memory region), ``code``/``message`` for status 1, and, for a
    sample encoded in shared memory (status 2, fakes and tests), ``offset``
    and ``length`` in the region."""

    position: int
    name: str
    status: int
    data: Optional[bytes] = None
    code: Optional[int] = None
    message: Optional[str] = None
    offset: Optional[int] = None
    length: Optional[int] = None


class Samples(NamedTuple):
    end: bool
    samples: list  # of Sample


class Data(NamedTuple):
    data: bytes


class Goodbye(NamedTuple):
    pass


class Error(NamedTuple):
    code: int
    fatal: bool
    message: str


# --------------------------------------------------------------------------
# Encoding.

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_HEADER = struct.Struct(">IB")


def integer(value, what: str, bits: Optional[int] = None) -> int:
    """``value`` as a Python ``int``: an ``int`` or a value of another
    integer type (NumPy's, a 0-d tensor: what ``operator.index`` takes),
    never a ``bool``; with ``bits``, in ``[0, 2^bits)``."""
    try:
        got = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        got = None
    if got is None or (bits is not None and not 0 <= got < (1 << bits)):
        within = f" in [0, 2^{bits})" if bits is not None else ""
        raise ValueError(f"{what} must be an integer{within}, got {value!r}")
    return got


def _u(bits: int, value: int, what: str) -> None:
    integer(value, what, bits)


def _enc_str(value: str, what: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        # What os.listdir gives for a name that is not UTF-8 (the stage
        # lists no such name: it serves names as UTF-8).
        raise ValueError(f"{what} {value!r} is not valid UTF-8 (a file name that is not UTF-8 "
                         "cannot be served: rename it)") from None
    if len(raw) > 0xFFFF:
        raise ValueError(f"{what} is {len(raw)} bytes of UTF-8; the protocol allows at most 65535")
    if b"\x00" in raw:
        raise ValueError(f"{what} must not contain NUL bytes: {value!r}")
    return _U16.pack(len(raw)) + raw


def _enc_bytes(value: bytes, what: str) -> bytes:
    if len(value) > 0xFFFFFFFF:
        raise ValueError(f"{what} is {len(value)} bytes; the protocol allows at most 2^32-1")
    return _U32.pack(len(value)) + bytes(value)


def _enc_map(value: Mapping[str, str], what: str) -> bytes:
    if len(value) > 0xFFFF:
        raise ValueError(f"{what} has {len(value)} entries; the protocol allows at most 65535")
    parts = [_U16.pack(len(value))]
    for k, v in value.items():
        parts.append(_enc_str(k, f"{what} key"))
        parts.append(_enc_str(v, f"{what} value for {k!r}"))
    return b"".join(parts)


def encode_frame(msg_type: int, payload: bytes = b"") -> bytes:
    """Returns a complete frame: length, type byte, payload."""
    return _HEADER.pack(len(payload) + 1, msg_type) + payload


def encode_hello(job: str, labels: Optional[Mapping[str, str]] = None, rank: int = 0,
                 world_size: int = 1, version: int = PROTOCOL_VERSION, features: int = 0) -> bytes:
    """Returns a ``HELLO`` frame (``features`` are sent from version 2 on)."""
    _u(16, version, "version")
    _u(32, rank, "rank")
    _u(32, world_size, "world_size")
    _u(32, features, "features")
    payload = (_U16.pack(version) + _enc_str(job, "job") + _enc_map(labels or {}, "labels")
               + struct.pack(">II", rank, world_size))
    if version >= 2:
        payload += _U32.pack(features)
    return encode_frame(MsgType.HELLO, payload)


def encode_open(dataset: str) -> bytes:
    """Returns an ``OPEN`` frame."""
    return encode_frame(MsgType.OPEN, _enc_str(dataset, "dataset name"))


def encode_list(offset: int, limit: int) -> bytes:
    """Returns a ``LIST`` frame."""
    _u(32, offset, "offset")
    _u(32, limit, "limit")
    return encode_frame(MsgType.LIST, struct.pack(">II", offset, limit))


def _plan_frame(epoch: int, kind: int, plan: bytes, run: int) -> bytes:
    """Returns a ``PLAN`` frame of ``kind`` whose plan fields are ``plan``,
    naming ``run`` when it is not 0 (a stage that granted ``RUNS``)."""
    _u(64, epoch, "epoch")
    _u(64, run, "run")
    if run:
        return encode_frame(MsgType.PLAN, struct.pack(">QB", epoch, kind | PLAN_WITH_RUN) + plan
                            + _U64.pack(run))
    return encode_frame(MsgType.PLAN, struct.pack(">QB", epoch, kind) + plan)


def encode_plan_indices(epoch: int, indices: Sequence[int], run: int = 0) -> bytes:
    """Returns a ``PLAN`` frame of kind ``INDICES``."""
    n = len(indices)
    _u(32, n, "index count")
    try:
        body = struct.pack(f">{n}I", *indices)
    except struct.error:
        bad = next((i for i in indices if not isinstance(i, int) or not 0 <= i <= 0xFFFFFFFF), None)
        raise ValueError(f"plan indices must be integers in [0, 2^32), found {bad!r}") from None
    return _plan_frame(epoch, PlanKind.INDICES, _U32.pack(n) + body, run)


def encode_plan_names(epoch: int, names: Sequence[str], run: int = 0) -> bytes:
    """Returns a ``PLAN`` frame of kind ``NAMES``."""
    _u(32, len(names), "name count")
    parts = [_U32.pack(len(names))]
    parts.extend(_enc_str(n, "plan name") for n in names)
    return _plan_frame(epoch, PlanKind.NAMES, b"".join(parts), run)


def encode_plan_shuffle(epoch: int, seed: int, shuffle: bool, file_count: int, digest: int,
                        run: int = 0) -> bytes:
    """Returns a ``PLAN`` frame of kind ``SHUFFLE``."""
    _u(64, seed, "seed")
    _u(32, file_count, "file_count")
    _u(64, digest, "digest")
    plan = struct.pack(">QBIQ", seed, 1 if shuffle else 0, file_count, digest)
    return _plan_frame(epoch, PlanKind.SHUFFLE, plan, run)


def encode_next(max_samples: int) -> bytes:
    """Returns a ``NEXT`` frame."""
    _u(32, max_samples, "max_samples")
    return encode_frame(MsgType.NEXT, _U32.pack(max_samples))


def encode_read(name: str, offset: int = 0, length: int = READ_TO_END) -> bytes:
    """Returns a ``READ`` frame (``length`` ``READ_TO_END`` reads to the end)."""
    _u(64, offset, "offset")
    _u(64, length, "length")
    return encode_frame(MsgType.READ, _enc_str(name, "file name") + struct.pack(">QQ", offset, length))


def encode_bye() -> bytes:
    """Returns a ``BYE`` frame."""
    return encode_frame(MsgType.BYE)


def _enc_offsets(offsets: Sequence[int]) -> bytes:
    for o in offsets:
        _u(64, o, "slot offset")
    return _U32.pack(len(offsets)) + struct.pack(f">{len(offsets)}Q", *offsets)


def encode_release(offsets: Sequence[int]) -> bytes:
    """Returns a ``RELEASE`` frame (version 2; it has no answer)."""
    return encode_frame(MsgType.RELEASE, _enc_offsets(offsets))


def encode_hand_off(offsets: Sequence[int]) -> bytes:
    """Returns a ``HAND_OFF`` frame (version 2; it has no answer)."""
    return encode_frame(MsgType.HAND_OFF, _enc_offsets(offsets))


def encode_take(offsets: Sequence[int]) -> bytes:
    """Returns a ``TAKE`` frame (version 2, feature ``TAKES``; it has no
    answer)."""
    return encode_frame(MsgType.TAKE, _enc_offsets(offsets))


def encode_run(run: int) -> bytes:
    """Returns a ``RUN`` frame (version 2, feature ``RUN_READS``; it has no
    answer)."""
    _u(64, run, "run")
    return encode_frame(MsgType.RUN, _U64.pack(run))


def encode_fetch(names: Sequence[str]) -> bytes:
    """Returns a ``FETCH`` frame (version 2): whole files by name."""
    _u(32, len(names), "name count")
    return encode_frame(MsgType.FETCH, _U32.pack(len(names)) + b"".join(_enc_str(n, "file name") for n in names))


def encode_welcome(stage_id: str, max_request_frame: int = MAX_REQUEST_FRAME,
                   max_response_frame: int = MAX_RESPONSE_FRAME,
                   version: int = PROTOCOL_VERSION, features: int = 0, region_bytes: int = 0) -> bytes:
    """Returns a ``WELCOME`` frame."""
    payload = (_U16.pack(version) + _enc_str(stage_id, "stage_id")
               + struct.pack(">II", max_request_frame, max_response_frame))
    if version >= 2:
        payload += struct.pack(">IQ", features, region_bytes)
    return encode_frame(MsgType.WELCOME, payload)


def encode_opened(file_count: int, total_bytes: int, digest: int) -> bytes:
    """Returns an ``OPENED`` frame."""
    return encode_frame(MsgType.OPENED, struct.pack(">IQQ", file_count, total_bytes, digest))


def encode_files(total: int, entries: Sequence[Tuple[str, int]]) -> bytes:
    """Returns a ``FILES`` frame."""
    parts = [struct.pack(">II", total, len(entries))]
    for name, size in entries:
        parts.append(_enc_str(name, "file name"))
        parts.append(_U64.pack(size))
    return encode_frame(MsgType.FILES, b"".join(parts))


def encode_planned(length: int, state: int) -> bytes:
    """Returns a ``PLANNED`` frame."""
    return encode_frame(MsgType.PLANNED, struct.pack(">IB", length, state))


def encode_samples(end: bool, samples: Sequence[Sample]) -> bytes:
    """Returns a ``SAMPLES`` frame."""
    parts = [struct.pack(">BI", 1 if end else 0, len(samples))]
    for s in samples:
        parts.append(_U32.pack(s.position) + _enc_str(s.name, "sample name") + _U8.pack(s.status))
        if s.status == SAMPLE_OK:
            parts.append(_enc_bytes(s.data, "sample data"))
        elif s.status == SAMPLE_SHARED:
            parts.append(_U64.pack(s.offset) + _U64.pack(s.length))
        else:
            parts.append(_U16.pack(s.code) + _enc_str(s.message, "sample error message"))
    return encode_frame(MsgType.SAMPLES, b"".join(parts))


def encode_data(data: bytes) -> bytes:
    """Returns a ``DATA`` frame."""
    return encode_frame(MsgType.DATA, _enc_bytes(data, "data"))


def encode_goodbye() -> bytes:
    """Returns a ``GOODBYE`` frame."""
    return encode_frame(MsgType.GOODBYE)


def encode_error(code: int, message: str, fatal: bool = False) -> bytes:
    """Returns an ``ERROR`` frame."""
    return encode_frame(MsgType.ERROR, struct.pack(">HB", code, 1 if fatal else 0)
                        + _enc_str(message, "error message"))


# --------------------------------------------------------------------------
# Decoding a payload held in memory.


class _Decoder:
    """Reads fields from one payload and checks it is consumed exactly."""

    __slots__ = ("buf", "pos")

    def __init__(self, payload) -> None:
        self.buf = memoryview(payload)
        self.pos = 0

    def _take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise FrameError(f"{what} runs past the end of the frame "
                             f"(needs {n} bytes at offset {self.pos}, frame payload is {len(self.buf)})")
        view = self.buf[self.pos:end]
        self.pos = end
        return view

    def fixed(self, st: struct.Struct, what: str):
        return st.unpack(self._take(st.size, what))

    def u8(self, what: str) -> int:
        return self.fixed(_U8, what)[0]

    def u16(self, what: str) -> int:
        return self.fixed(_U16, what)[0]

    def u32(self, what: str) -> int:
        return self.fixed(_U32, what)[0]

    def u64(self, what: str) -> int:
        return self.fixed(_U64, what)[0]

    def text(self, what: str) -> str:
        n = self.u16(f"length of {what}")
        return _utf8(self._take(n, what), what)

    def blob(self, what: str) -> bytes:
        n = self.u32(f"length of {what}")
        return bytes(self._take(n, what))

    def pairs(self, what: str) -> Dict[str, str]:
        n = self.u16(f"count of {what}")
        out = {}
        for _ in range(n):
            k = self.text(f"{what} key")
            out[k] = self.text(f"{what} value")
        return out

    def flag(self, what: str) -> bool:
        v = self.u8(what)
        if v > 1:
            raise FrameError(f"{what} must be 0 or 1, got {v}")
        return v == 1

    def finish(self, what: str) -> None:
        left = len(self.buf) - self.pos
        if left:
            raise FrameError(f"{left} bytes left over after the {what} payload")


def _utf8(raw, what: str) -> str:
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FrameError(f"{what} is not valid UTF-8: {e}") from None
    if "\x00" in text:
        raise FrameError(f"{what} contains a NUL byte")
    return text


def decode_request(msg_type: int, payload) -> tuple:
    """Returns the request message for one frame's type and payload.

    Raises :class:`FrameError` for an unknown type or a malformed payload.
    """
    d = _Decoder(payload)
    if msg_type == MsgType.HELLO:
        version = d.u16("version")
        msg = Hello(version, d.text("job"), d.pairs("labels"), d.u32("rank"), d.u32("world_size"),
                    d.u32("features") if version >= 2 else 0)
    elif msg_type == MsgType.OPEN:
        msg = Open(d.text("dataset"))
    elif msg_type == MsgType.LIST:
        msg = ListFiles(d.u32("offset"), d.u32("limit"))
    elif msg_type == MsgType.PLAN:
        epoch = d.u64("epoch")
        flags = d.u8("plan kind")
        kind = flags & ~PLAN_WITH_RUN
        if kind == PlanKind.INDICES:
            n = d.u32("index count")
            raw = d._take(4 * n, "plan indices")
            msg = Plan(epoch, kind, indices=list(struct.unpack(f">{n}I", raw)))
        elif kind == PlanKind.NAMES:
            n = d.u32("name count")
            msg = Plan(epoch, kind, names=[d.text("plan name") for _ in range(n)])
        elif kind == PlanKind.SHUFFLE:
            msg = Plan(epoch, kind, seed=d.u64("seed"), shuffle=d.flag("shuffle"),
                       file_count=d.u32("file_count"), digest=d.u64("digest"))
        else:
            raise FrameError(f"unknown plan kind {kind}")
        if flags & PLAN_WITH_RUN:
            msg = msg._replace(run=d.u64("run"))
    elif msg_type == MsgType.NEXT:
        msg = Next(d.u32("max_samples"))
    elif msg_type == MsgType.READ:
        msg = Read(d.text("name"), d.u64("offset"), d.u64("length"))
    elif msg_type == MsgType.BYE:
        msg = Bye()
    elif msg_type in (MsgType.RELEASE, MsgType.HAND_OFF):
        n = d.u32("slot count")
        offsets = list(struct.unpack(f">{n}Q", d._take(8 * n, "slot offsets")))
        msg = Release(offsets) if msg_type == MsgType.RELEASE else HandOff(offsets)
    elif msg_type == MsgType.FETCH:
        n = d.u32("name count")
        msg = Fetch([d.text("file name") for _ in range(n)])
    elif msg_type == MsgType.RUN:
        msg = Run(d.u64("run"))
    else:
        raise FrameError(f"unknown request type 0x{msg_type:02x}")
    d.finish(MsgType(msg_type).name)
    return msg


def decode_response(msg_type: int, payload) -> tuple:
    """Returns the response message for one frame's type and payload.

    Raises :class:`FrameError` for an unknown type or a malformed payload.
    """
    d = _Decoder(payload)
    if msg_type == MsgType.WELCOME:
        version = d.u16("version")
        stage_id, max_req, max_resp = d.text("stage_id"), d.u32("max_request_frame"), d.u32("max_response_frame")
        if version >= 2:
            msg = Welcome(version, stage_id, max_req, max_resp, d.u32("features"), d.u64("region bytes"))
        else:
            msg = Welcome(version, stage_id, max_req, max_resp)
    elif msg_type == MsgType.OPENED:
        msg = Opened(d.u32("file_count"), d.u64("total_bytes"), d.u64("digest"))
    elif msg_type == MsgType.FILES:
        total = d.u32("total")
        n = d.u32("count")
        msg = Files(total, [(d.text("file name"), d.u64("file size")) for _ in range(n)])
    elif msg_type == MsgType.PLANNED:
        msg = Planned(d.u32("length"), d.u8("state"))
    elif msg_type == MsgType.SAMPLES:
        flags = d.u8("flags")
        n = d.u32("sample count")
        samples = []
        for _ in range(n):
            pos = d.u32("sample position")
            name = d.text("sample name")
            status = d.u8("sample status")
            if status == SAMPLE_OK:
                samples.append(Sample(pos, name, status, data=d.blob("sample data")))
            elif status == SAMPLE_ERROR:
                samples.append(Sample(pos, name, status, code=d.u16("sample error code"),
                                      message=d.text("sample error message")))
            elif status == SAMPLE_SHARED:
                samples.append(Sample(pos, name, status, offset=d.u64("slot offset"),
                                      length=d.u64("sample length")))
            else:
                raise FrameError(f"unknown sample status {status} for {name!r}")
        msg = Samples(bool(flags & 1), samples)
    elif msg_type == MsgType.DATA:
        msg = Data(d.blob("data"))
    elif msg_type == MsgType.GOODBYE:
        msg = Goodbye()
    elif msg_type == MsgType.ERROR:
        msg = Error(d.u16("error code"), d.flag("fatal flag"), d.text("error message"))
    else:
        raise FrameError(f"unknown response type 0x{msg_type:02x}")
    d.finish(MsgType(msg_type).name)
    return msg


def split_frame(frame, max_length: int) -> Tuple[int, memoryview]:
    """Returns ``(type, payload)`` of one complete frame held in memory.

    Raises :class:`FrameError` when the length field is 0, over
    ``max_length``, or disagrees with the bytes given.
    """
    view = memoryview(frame)
    if len(view) < 5:
        raise FrameError(f"a frame needs at least 5 bytes, got {len(view)}")
    length, msg_type = _HEADER.unpack(view[:5])
    _check_length(length, max_length)
    if len(view) - 4 != length:
        raise FrameError(f"frame length field says {length} bytes but {len(view) - 4} follow it")
    return msg_type, view[5:]


def _check_length(length: int, max_length: int) -> None:
    if length == 0:
        raise FrameError("frame length is 0; it must count at least the type byte")
    if length > max_length:
        raise FrameError(f"frame length {length} is over the limit of {max_length} bytes")


# --------------------------------------------------------------------------
# Reading a response straight off a buffered socket file.

_SAMPLE_HEAD = struct.Struct(">IH")   # position, name length
_SAMPLES_HEAD = struct.Struct(">BI")  # flags, count


class _Stream:
    """Reads the fields of one frame off a file, never past its end."""

    __slots__ = ("f", "left")

    def __init__(self, f: BinaryIO, left: int) -> None:
        self.f = f
        self.left = left

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise FrameError(f"{what} runs past the end of the frame "
                             f"(needs {n} bytes, {self.left} left)")
        data = self.f.read(n)
        if len(data) != n:
            raise ConnectionClosedError(
                f"the stage closed the connection in the middle of a frame "
                f"(wanted {n} bytes of {what}, got {len(data)})", fatal=True)
        self.left -= n
        return data


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        if not data:
            raise ConnectionClosedError(f"the stage closed the connection while {what}", fatal=True)
        raise ConnectionClosedError(
            f"the stage closed the connection in the middle of a frame while {what} "
            f"(got {len(data)} of {n} bytes)", fatal=True)
    return data


def read_response(f: BinaryIO, max_length: int = MAX_RESPONSE_FRAME, shared=None) -> tuple:
    """Reads one response frame from ``f`` and returns its message.

    ``shared(offset, length)`` turns a sample the stage placed in shared
    memory into its data (a view of the region); without it such a sample
    is a protocol error (the connection did not negotiate shared memory).

    ``f`` is a buffered binary file (``sock.makefile("rb")``). ``SAMPLES`` and
    ``DATA`` are parsed while streaming: each sample's data is one
    ``f.read(n)``, which for large ``n`` reads from the socket straight into
    the returned ``bytes`` object. Other responses are small and decoded from
    one payload read.

    Raises :class:`ConnectionClosedError` when the stream ends, and
    :class:`ProtocolError` when the frame is malformed (the stream is then
    out of step and must be closed).
    """
    length, msg_type = _HEADER.unpack(_read_exact(f, 5, "waiting for a response"))
    try:
        _check_length(length, max_length)
        if msg_type == MsgType.SAMPLES:
            return _read_samples(_Stream(f, length - 1), shared)
        if msg_type == MsgType.DATA:
            s = _Stream(f, length - 1)
            (n,) = _U32.unpack(s.take(4, "length of data"))
            data = s.take(n, "data")
            if s.left:
                raise FrameError(f"{s.left} bytes left over after the DATA payload")
            return Data(data)
        payload = _read_exact(f, length - 1, f"reading a frame of type 0x{msg_type:02x}")
        return decode_response(msg_type, payload)
    except FrameError as e:
        raise ProtocolError(f"malformed response from the stage: {e}", fatal=True) from None


_SHARED_REST = struct.Struct(">IQ")  # the rest of a shared sample's offset, its length
_SHARED_BOTH = struct.Struct(">QQ")  # a shared sample's offset and length


#: A ``SAMPLES`` frame at most this long is read whole and parsed in
#: memory (one read instead of several per sample): in shared memory a
#: sample takes a few dozen bytes of the frame.
_SMALL_FRAME = 256 << 10


def _read_samples(s: _Stream, shared=None) -> Samples:
    if s.left <= _SMALL_FRAME:
        return _parse_samples(s.take(s.left, "SAMPLES payload"), shared)
    flags, count = _SAMPLES_HEAD.unpack(s.take(5, "SAMPLES header"))
    samples = []
    append = samples.append
    take = s.take
    unpack_head = _SAMPLE_HEAD.unpack
    for _ in range(count):
        pos, name_len = unpack_head(take(6, "sample header"))
        # The name, the status byte and the next 4 bytes come in one read:
        # for status 0 they are the data length, for status 1 code + length.
        rest = take(name_len + 5, "sample name and status")
        name = _utf8(rest[:name_len], "sample name")
        status = rest[name_len]
        if status == SAMPLE_OK:
            (n,) = _U32.unpack_from(rest, name_len + 1)
            append(Sample(pos, name, SAMPLE_OK, take(n, "sample data")))
        elif status == SAMPLE_ERROR:
            code, msg_len = struct.unpack_from(">HH", rest, name_len + 1)
            message = _utf8(take(msg_len, "sample error message"), "sample error message")
            append(Sample(pos, name, SAMPLE_ERROR, None, code, message))
        elif status == SAMPLE_SHARED and shared is not None:
            (high,) = _U32.unpack_from(rest, name_len + 1)
            low, length = _SHARED_REST.unpack(take(12, "shared sample offset and length"))
            append(Sample(pos, name, SAMPLE_OK, shared((high << 32) | low, length)))
        else:
            raise FrameError(f"unknown sample status {status} for {name!r}")
    if s.left:
        raise FrameError(f"{s.left} bytes left over after the SAMPLES payload")
    return Samples(bool(flags & 1), samples)


def _parse_samples(payload: bytes, shared) -> Samples:
    """Parses a whole ``SAMPLES`` payload held in memory (the client's fast
    path for small frames; same rules as the streaming reader)."""
    n = len(payload)
    if n < 5:
        raise FrameError("SAMPLES header runs past the end of the frame")
    flags, count = _SAMPLES_HEAD.unpack_from(payload, 0)
    pos = 5
    samples = []
    append = samples.append
    unpack_head = _SAMPLE_HEAD.unpack_from
    try:
        for _ in range(count):
            position, name_len = unpack_head(payload, pos)
            pos += 6
            end = pos + name_len
            if end + 1 > n:
                raise FrameError("sample name and status run past the end of the frame")
            name = _utf8(payload[pos:end], "sample name")
            status = payload[end]
            pos = end + 1
            if status == SAMPLE_SHARED and shared is not None:
                offset, length = _SHARED_BOTH.unpack_from(payload, pos)
                pos += 16
                append(Sample(position, name, SAMPLE_OK, shared(offset, length)))
            elif status == SAMPLE_OK:
                (size,) = _U32.unpack_from(payload, pos)
                pos += 4
                if pos + size > n:
                    raise FrameError("sample data runs past the end of the frame")
                append(Sample(position, name, SAMPLE_OK, payload[pos:pos + size]))
                pos += size
            elif status == SAMPLE_ERROR:
                code, msg_len = struct.unpack_from(">HH", payload, pos)
                pos += 4
                if pos + msg_len > n:
                    raise FrameError("sample error message runs past the end of the frame")
                message = _utf8(payload[pos:pos + msg_len], "sample error message")
                pos += msg_len
                append(Sample(position, name, SAMPLE_ERROR, None, code, message))
            else:
                raise FrameError(f"unknown sample status {status} for {name!r}")
    except struct.error:
        raise FrameError("a sample runs past the end of the frame") from None
    if pos != n:
        raise FrameError(f"{n - pos} bytes left over after the SAMPLES payload")
    return Samples(bool(flags & 1), samples)
