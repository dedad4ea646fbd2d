"""Frame codec: round trips, malformed and oversized frames."""

import io
import os
import struct

import pytest

from sluice import protocol as p
from sluice.errors import ConnectionClosedError, ProtocolError

REQUESTS = [
    (p.encode_hello("job-1.a_b", {"team": "vision", "prio": ""}, 3, 8, version=1),
     p.Hello(1, "job-1.a_b", {"team": "vision", "prio": ""}, 3, 8)),
    (p.encode_hello("j", {}, 0, 1, features=p.FEATURE_SHARED_MEMORY),
     p.Hello(2, "j", {}, 0, 1, p.FEATURE_SHARED_MEMORY)),
    (p.encode_open("imagenet"), p.Open("imagenet")),
    (p.encode_list(65536, 65536), p.ListFiles(65536, 65536)),
    (p.encode_plan_indices(7, [0, 5, 5, 2**32 - 1]), p.Plan(7, p.PlanKind.INDICES, indices=[0, 5, 5, 2**32 - 1])),
    (p.encode_plan_indices(0, []), p.Plan(0, p.PlanKind.INDICES, indices=[])),
    (p.encode_plan_names(2**64 - 1, ["a/b", "é/ü.jpg"]), p.Plan(2**64 - 1, p.PlanKind.NAMES, names=["a/b", "é/ü.jpg"])),
    (p.encode_plan_shuffle(3, 42, True, 10, 2**64 - 1),
     p.Plan(3, p.PlanKind.SHUFFLE, seed=42, shuffle=True, file_count=10, digest=2**64 - 1)),
    (p.encode_plan_shuffle(3, 42, False, 10, 1),
     p.Plan(3, p.PlanKind.SHUFFLE, seed=42, shuffle=False, file_count=10, digest=1)),
    (p.encode_plan_shuffle(3, 42, False, 10, 1, run=2**64 - 1),
     p.Plan(3, p.PlanKind.SHUFFLE, seed=42, shuffle=False, file_count=10, digest=1, run=2**64 - 1)),
    (p.encode_plan_indices(7, [4, 2], run=1), p.Plan(7, p.PlanKind.INDICES, indices=[4, 2], run=1)),
    (p.encode_plan_names(0, ["a"], run=0x5EED), p.Plan(0, p.PlanKind.NAMES, names=["a"], run=0x5EED)),
    (p.encode_next(4096), p.Next(4096)),
    (p.encode_read("x/y", 10, p.READ_TO_END), p.Read("x/y", 10, p.READ_TO_END)),
    (p.encode_bye(), p.Bye()),
    (p.encode_release([0, 4096, 2**40]), p.Release([0, 4096, 2**40])),
    (p.encode_release([]), p.Release([])),
    (p.encode_hand_off([8192]), p.HandOff([8192])),
    (p.encode_run(2**64 - 1), p.Run(2**64 - 1)),
    (p.encode_fetch(["a/b.jpg", "c"]), p.Fetch(["a/b.jpg", "c"])),
]

RESPONSES = [
    (p.encode_welcome("stage-a", 16 << 20, 256 << 20, version=1), p.Welcome(1, "stage-a", 16 << 20, 256 << 20)),
    (p.encode_welcome("stage-a", 16 << 20, 256 << 20, features=1, region_bytes=1 << 30),
     p.Welcome(2, "stage-a", 16 << 20, 256 << 20, 1, 1 << 30)),
    (p.encode_opened(3, 2**40, 0xCBF29CE484222325), p.Opened(3, 2**40, 0xCBF29CE484222325)),
    (p.encode_files(3, [("a", 0), ("b/c", 2**33)]), p.Files(3, [("a", 0), ("b/c", 2**33)])),
    (p.encode_planned(10, 1), p.Planned(10, 1)),
    (p.encode_samples(False, [p.Sample(0, "a", 0, b""), p.Sample(9, "ü/b", 0, b"\x00" * 1000),
                              p.Sample(4, "gone", 1, None, 12, "no such file: gone")]),
     p.Samples(False, [p.Sample(0, "a", 0, b""), p.Sample(9, "ü/b", 0, b"\x00" * 1000),
                       p.Sample(4, "gone", 1, None, 12, "no such file: gone")])),
    (p.encode_samples(True, []), p.Samples(True, [])),
    (p.encode_data(b"hello"), p.Data(b"hello")),
    (p.encode_data(b""), p.Data(b"")),
    (p.encode_goodbye(), p.Goodbye()),
    (p.encode_error(13, "name leaves the dataset root", True), p.Error(13, True, "name leaves the dataset root")),
]


@pytest.mark.parametrize("frame,msg", REQUESTS)
def test_request_round_trip(frame, msg):
    assert p.decode_request(*p.split_frame(frame, p.MAX_REQUEST_FRAME)) == msg


@pytest.mark.parametrize("frame,msg", RESPONSES)
def test_response_round_trip(frame, msg):
    assert p.decode_response(*p.split_frame(frame, p.MAX_RESPONSE_FRAME)) == msg
    # The streaming reader used by the client agrees with the in-memory decoder.
    f = io.BufferedReader(io.BytesIO(frame + frame), buffer_size=7)
    assert p.read_response(f) == msg
    assert p.read_response(f) == msg


def test_shared_samples_become_views_of_the_region():
    frame = p.encode_samples(False, [p.Sample(0, "a", p.SAMPLE_SHARED, offset=2**33 + 4096, length=7),
                                     p.Sample(1, "b", 0, b"xy")])
    # In memory: the wire form.
    wire = p.decode_response(*p.split_frame(frame, p.MAX_RESPONSE_FRAME))
    assert wire.samples[0] == p.Sample(0, "a", p.SAMPLE_SHARED, offset=2**33 + 4096, length=7)
    # Streamed by the client: the data is what the region gives for it.
    got = p.read_response(io.BufferedReader(io.BytesIO(frame)), shared=lambda o, n: ("view", o, n))
    assert got.samples == [p.Sample(0, "a", 0, ("view", 2**33 + 4096, 7)), p.Sample(1, "b", 0, b"xy")]
    # Without a region a shared sample is a protocol error.
    with pytest.raises(ProtocolError):
        p.read_response(io.BufferedReader(io.BytesIO(frame)))


def test_frame_layout_is_big_endian():
    frame = p.encode_next(258)
    assert frame == b"\x00\x00\x00\x05\x05\x00\x00\x01\x02"
    assert p.encode_open("ab") == b"\x00\x00\x00\x05\x02\x00\x02ab"
    assert p.encode_bye() == b"\x00\x00\x00\x01\x07"


@pytest.mark.parametrize("frame,_", REQUESTS + RESPONSES)
def test_every_truncation_is_rejected(frame, _):
    decode = p.decode_request if frame[4] < 0x80 else p.decode_response
    msg_type = frame[4]
    payload = frame[5:]
    for cut in range(len(payload)):
        with pytest.raises(p.FrameError):
            decode(msg_type, payload[:cut])
    with pytest.raises(p.FrameError, match="left over"):
        decode(msg_type, payload + b"\x00")


def test_truncated_frame_on_a_stream_is_a_closed_connection():
    frame = p.encode_samples(True, [p.Sample(0, "a", 0, b"x" * 100)])
    for cut in (0, 3, 5, 20, len(frame) - 1):
        with pytest.raises(ConnectionClosedError):
            p.read_response(io.BytesIO(frame[:cut]))


def test_lengths_out_of_bounds():
    with pytest.raises(p.FrameError, match="at least the type byte"):
        p.split_frame(b"\x00\x00\x00\x00\x01", p.MAX_REQUEST_FRAME)
    big = struct.pack(">IB", p.MAX_REQUEST_FRAME + 1, 1)
    with pytest.raises(p.FrameError, match="over the limit"):
        p.split_frame(big, p.MAX_REQUEST_FRAME)
    with pytest.raises(p.FrameError, match="says"):
        p.split_frame(p.encode_next(1) + b"x", p.MAX_REQUEST_FRAME)
    # The streaming reader refuses an oversized frame before reading its body.
    f = io.BytesIO(struct.pack(">IB", 1000, p.MsgType.DATA) + b"\x00" * 10)
    with pytest.raises(ProtocolError, match="over the limit"):
        p.read_response(f, max_length=999)
    assert f.tell() == 5
    with pytest.raises(ProtocolError):
        p.read_response(io.BytesIO(b"\x00\x00\x00\x00\x86"))


def test_field_running_past_a_streamed_frame():
    # A DATA frame whose bytes length claims more than the frame holds.
    frame = struct.pack(">IBI", 1 + 4 + 3, p.MsgType.DATA, 10) + b"abc"
    with pytest.raises(ProtocolError, match="runs past the end"):
        p.read_response(io.BytesIO(frame + b"\x00" * 20))
    # A SAMPLES frame with a sample the count does not cover.
    frame = bytearray(p.encode_samples(False, [p.Sample(0, "a", 0, b"x")]))
    frame[5:10] = struct.pack(">BI", 0, 0)
    with pytest.raises(ProtocolError, match="left over"):
        p.read_response(io.BytesIO(bytes(frame)))


def test_malformed_payloads():
    with pytest.raises(p.FrameError, match="unknown request type"):
        p.decode_request(0x42, b"")
    with pytest.raises(p.FrameError, match="unknown response type"):
        p.decode_response(0x01, b"")
    with pytest.raises(p.FrameError, match="unknown plan kind"):
        p.decode_request(p.MsgType.PLAN, struct.pack(">QB", 0, 9))
    with pytest.raises(p.FrameError, match="UTF-8"):
        p.decode_request(p.MsgType.OPEN, b"\x00\x02\xff\xfe")
    with pytest.raises(p.FrameError, match="NUL"):
        p.decode_request(p.MsgType.OPEN, b"\x00\x02a\x00")
    with pytest.raises(p.FrameError, match="0 or 1"):
        p.decode_response(p.MsgType.ERROR, struct.pack(">HB", 1, 2) + b"\x00\x00")
    bad_status = struct.pack(">BIIH", 0, 1, 0, 1) + b"a" + b"\x07" + b"\x00" * 4
    with pytest.raises(p.FrameError, match="sample status"):
        p.decode_response(p.MsgType.SAMPLES, bad_status)
    with pytest.raises(ProtocolError, match="sample status"):
        p.read_response(io.BytesIO(p.encode_frame(p.MsgType.SAMPLES, bad_status)))


def test_encoders_validate_fields():
    with pytest.raises(ValueError, match="rank"):
        p.encode_hello("j", rank=2**32)
    with pytest.raises(ValueError, match="65535"):
        p.encode_open("x" * 70000)
    with pytest.raises(ValueError, match="NUL"):
        p.encode_read("a\x00b")
    # A name os.listdir gives for bytes that are not UTF-8.
    with pytest.raises(ValueError, match="is not valid UTF-8"):
        p.encode_read(os.fsdecode(b"bad\xff"))
    with pytest.raises(ValueError, match="plan indices"):
        p.encode_plan_indices(0, [1, -1])
    with pytest.raises(TypeError):
        p.encode_open(b"bytes")
