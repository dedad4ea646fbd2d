"""Address parsing, byte quantities and the error types."""

import pathlib
import pickle

import pytest

import sluice
from sluice.bench.units import format_bytes, parse_bytes
from sluice.client import parse_address


@pytest.mark.parametrize("text,expected", [
    ("/run/sluice/stage.sock", ("unix", "/run/sluice/stage.sock")),
    ("./stage.sock", ("unix", "./stage.sock")),
    ("stage.sock", ("unix", "stage.sock")),
    ("unix:///tmp/x.sock", ("unix", "/tmp/x.sock")),
    ("tcp://127.0.0.1:7300", ("tcp", ("127.0.0.1", 7300))),
    ("tcp://stage.local:1", ("tcp", ("stage.local", 1))),
    ("localhost:7300", ("tcp", ("localhost", 7300))),
    ("[::1]:7300", ("tcp", ("::1", 7300))),
    ("tcp://[fe80::1]:80", ("tcp", ("fe80::1", 80))),
    (("10.0.0.1", 9), ("tcp", ("10.0.0.1", 9))),
    (pathlib.Path("/a/b.sock"), ("unix", "/a/b.sock")),
])
def test_address_forms(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("bad,match", [
    ("", "non-empty"),
    ("unix://", "names no socket path"),
    ("http://x:1", "unknown scheme"),
    ("tcp://host", "host:port"),
    ("host:port", "not a number"),
    ("host:0", "1..65535"),
    ("tcp://:80", "host:port"),
    ("[::1]80", "ipv6"),
])
def test_bad_addresses(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_address(bad)


def test_connecting_to_nothing_says_what_to_check(tmp_path):
    with pytest.raises(sluice.ConnectionClosedError, match="is sluice-stage running"):
        sluice.Client(str(tmp_path / "missing.sock"), job="j")
    with pytest.raises(ValueError, match="rank"):
        sluice.Client(str(tmp_path / "missing.sock"), job="j", rank=1, world_size=1)


def byte_size_cases():
    """The table the Rust parser is tested against too."""
    table = pathlib.Path(__file__).resolve().parents[3] / "policies" / "src" / "byte_size_cases.txt"
    cases = []
    for line in table.read_text().splitlines():
        if line and not line.startswith("#"):
            text, want = line.rsplit("|", 1)
            cases.append(pytest.param(text, want, id=repr(text)))
    assert len(cases) >= 30
    return cases


@pytest.mark.parametrize("text,want", byte_size_cases())
def test_byte_sizes_read_as_the_stage_reads_them(text, want):
    if want.startswith("error: "):
        with pytest.raises(ValueError) as e:
            parse_bytes(text)
        assert want[len("error: "):] in str(e.value)
    else:
        assert parse_bytes(text) == int(want)


def test_parse_bytes_takes_integers():
    assert parse_bytes(17) == 17
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-1)


def test_format_bytes():
    assert format_bytes(100 * 1024) == "100KiB"
    assert format_bytes(1536 * 1024**2) == "1.5GiB"
    assert format_bytes(10) == "10B"


def test_error_mapping():
    e = sluice.errors.error_from_code(12, "no such file: a/b", name="a/b")
    assert isinstance(e, sluice.NotFoundError) and isinstance(e, sluice.SluiceError)
    assert (e.code, e.code_name, e.message, e.fatal, e.name) == (12, "NOT_FOUND", "no such file: a/b", False, "a/b")
    assert "NOT_FOUND" in str(e) and "a/b" in str(e)
    assert isinstance(sluice.errors.error_from_code(13, "x"), sluice.ForbiddenPathError)
    assert isinstance(sluice.errors.error_from_code(14, "x"), sluice.SluiceIOError)
    fatal = sluice.errors.error_from_code(2, "too big", fatal=True)
    assert isinstance(fatal, sluice.FrameTooLargeError) and fatal.fatal and "closed" in str(fatal)
    unknown = sluice.errors.error_from_code(999, "new")
    assert type(unknown) is sluice.SluiceError and unknown.code_name == "UNKNOWN_999"
    assert sluice.ConnectionClosedError("gone").code is None
    assert sluice.ConnectionClosedError("gone").code_name == "CONNECTION_CLOSED"
    # DataLoader workers pickle exceptions back to the main process.
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is sluice.NotFoundError and back.name == "a/b" and back.message == e.message


def test_import_sluice_does_not_import_torch():
    import os
    import subprocess
    import sys
    code = ("import sys, sluice, sluice.client, sluice.plan, sluice.bench.prefetch; "
            "assert 'torch' not in sys.modules, 'import sluice pulled in torch'")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(sluice.__file__).parent.parent))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
