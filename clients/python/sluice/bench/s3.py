"""The S3 side of the slow-storage harness: a real S3-compatible server
(``s3s-fs``, from the Rust crate registry, installed by ``scripts/s3-server``)
serving a directory, behind ``sluice-slowhttp``, which adds a latency to
every request and injects the failures object stores give (503 SlowDown,
403 AccessDenied, dropped connections).

``s3s-fs`` serves each subdirectory of its root as a bucket and each file
beneath it as an object, so a data set is staged by writing files, and an
object is deleted by deleting its file. A file put there directly has no
stored ETag, and ``s3s-fs`` then hashes the whole object for every GET;
:func:`store_etags` writes the ETags an upload would have left, so the
server answers a GET as it would for an uploaded object.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from typing import Iterable, Optional

from .harness import Harness, HarnessError, find_binary, free_port

__all__ = ["S3Server", "SlowHttp", "find_s3_server", "find_slowhttp_binary", "store_etags",
           "ACCESS_KEY", "SECRET_KEY"]

# The harness server's credentials (a test server on loopback).
ACCESS_KEY = "sluice-test-key"
SECRET_KEY = "sluice-test-secret"


def find_s3_server(repo: str) -> str:
    """The ``s3s-fs`` binary: ``$SLUICE_S3_SERVER``, else the one
    ``scripts/s3-server`` installs under ``target/tools``, else PATH."""
    candidates = [os.environ.get("SLUICE_S3_SERVER"),
                  os.path.join(repo, "target", "tools", "bin", "s3s-fs"),
                  shutil.which("s3s-fs")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise HarnessError("no s3s-fs binary: install it with `scripts/s3-server` "
                       "(or point SLUICE_S3_SERVER at one)")


def find_slowhttp_binary(bin_dir: str) -> str:
    return find_binary(bin_dir, "sluice-slowhttp")


def store_etags(root: str, bucket: str, keys: Iterable[str]) -> int:
    """Records the ETag (the MD5 of the bytes, as S3 gives an object uploaded
    in one part) of each of ``keys`` in ``bucket`` under the server root
    ``root``, in the file where ``s3s-fs`` 0.14 keeps an uploaded object's
    ETag (``.bucket-<b64 bucket>.object-<b64 key>.internal.json`` beside the
    buckets). Returns how many were written."""
    def b64(text: str) -> str:
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    written = 0
    for key in keys:
        digest = hashlib.md5()
        with open(os.path.join(root, bucket, key), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        with open(os.path.join(root, f".bucket-{b64(bucket)}.object-{b64(key)}.internal.json"), "w") as out:
            json.dump({"e_tag": digest.hexdigest()}, out)
        written += 1
    return written


class S3Server(Harness):
    """``s3s-fs`` serving ``root`` on 127.0.0.1, checking request signatures
    against :data:`ACCESS_KEY` / :data:`SECRET_KEY`."""

    def __init__(self, proc, ready: dict, root: str, port: int) -> None:
        super().__init__(proc, ready)
        self.root = root
        self.address = f"127.0.0.1:{port}"

    @classmethod
    def start(cls, binary: str, root: str, timeout: float = 20.0,
              port: Optional[int] = None) -> "S3Server":
        """Serves ``root`` on ``port`` (a free one when not given)."""
        os.makedirs(root, exist_ok=True)
        port = port or free_port()
        args = [binary, "--host", "127.0.0.1", "--port", str(port),
                "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, root]
        proc, ready = Harness.launch(args, f"s3s-fs (serving {root})", timeout, port=port)
        return cls(proc, ready, root, port)


class SlowHttp(Harness):
    """``sluice-slowhttp`` in front of ``upstream`` (HOST:PORT)."""

    @property
    def endpoint(self) -> str:
        return f"http://{self.ready['listen']}"

    @classmethod
    def start(cls, binary: str, upstream: str, latency: str = "0ms", throttle_every: int = 0,
              reset_every: int = 0, deny: Optional[str] = None, timeout: float = 20.0,
              hang_every: int = 0, stall_body_every: int = 0, listen: str = "127.0.0.1:0") -> "SlowHttp":
        args = [binary, "--upstream", upstream, "--listen", listen, "--latency", latency,
                "--throttle-every", str(throttle_every), "--reset-every", str(reset_every),
                "--hang-every", str(hang_every), "--stall-body-every", str(stall_body_every)]
        if deny:
            args += ["--deny", deny]
        proc, ready = Harness.launch(args, "sluice-slowhttp", timeout)
        return cls(proc, ready)


class S3Reader:
    """GETs whole objects with AWS Signature V4 over keep-alive HTTP/1.1
    (one connection per thread or process): the baseline loaders' S3
    client, the standard library only. ``read(name)`` returns the bytes."""

    def __init__(self, endpoint: str, bucket: str, prefix: str = "", access_key: str = ACCESS_KEY,
                 secret_key: str = SECRET_KEY, region: str = "us-east-1") -> None:
        from urllib.parse import urlsplit
        parts = urlsplit(endpoint)
        if parts.scheme != "http":
            raise ValueError(f"the baseline S3 reader speaks plain http, not {endpoint!r}")
        self.host = parts.netloc
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.access_key, self.region = access_key, region
        self._secret = secret_key
        self._local = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_local"] = None
        return state

    def _connection(self):
        import http.client
        import threading
        if self._local is None:
            self._local = threading.local()
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            conn = http.client.HTTPConnection(self.host, timeout=60)
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def _headers(self, path: str) -> dict:
        import hashlib
        import hmac
        import time
        now = time.gmtime()
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", now)
        day = amz_date[:8]
        empty = hashlib.sha256(b"").hexdigest()
        signed = "host;x-amz-content-sha256;x-amz-date"
        canonical = (f"GET\n{path}\n\nhost:{self.host}\nx-amz-content-sha256:{empty}\n"
                     f"x-amz-date:{amz_date}\n\n{signed}\n{empty}")
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        key = ("AWS4" + self._secret).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        return {"Host": self.host, "x-amz-date": amz_date, "x-amz-content-sha256": empty,
                "Authorization": f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                                 f"SignedHeaders={signed}, Signature={signature}"}

    def read(self, name: str) -> bytes:
        from urllib.parse import quote
        key = f"{self.prefix}/{name}" if self.prefix else name
        path = "/" + quote(self.bucket) + "/" + quote(key, safe="/-_.~")
        for attempt in range(3):
            conn = self._connection()
            try:
                conn.request("GET", path, headers=self._headers(path))
                response = conn.getresponse()
                body = response.read()
            except (OSError, ConnectionError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if response.status != 200:
                raise OSError(f"GET {path}: HTTP {response.status}: {body[:200]!r}")
            return body
        raise AssertionError("unreachable")
