"""Errors raised by the sluice client.

Every error the stage reports (an ``ERROR`` frame, or a failed sample inside
``SAMPLES``) becomes a :class:`SluiceError` carrying the protocol's error
code, its name, the stage's own message and whether the connection is gone.
Each code has its own subclass (``NotFoundError``, ``ForbiddenPathError``,
...), so callers can catch exactly what they expect::

    try:
        data = ds.read("train/0001.jpg")
    except sluice.NotFoundError as e:
        print(e.code_name, e.message)

Errors the client detects itself (the connection closed, a malformed
response, a timeout) have ``code`` ``None`` and are always fatal.
"""

from __future__ import annotations

import enum
from typing import Optional

__all__ = [
    "ErrorCode",
    "SluiceError",
    "BadFrameError",
    "FrameTooLargeError",
    "UnsupportedVersionError",
    "OutOfOrderError",
    "InvalidArgumentError",
    "NoSuchDatasetError",
    "NoDatasetError",
    "NotFoundError",
    "ForbiddenPathError",
    "SluiceIOError",
    "BadPlanError",
    "PlanConflictError",
    "NoPlanError",
    "TooLargeError",
    "UnavailableError",
    "BadReleaseError",
    "ClaimRefusedError",
    "ConnectionClosedError",
    "ProtocolError",
    "StageTimeoutError",
    "error_from_code",
]


class ErrorCode(enum.IntEnum):
    """Error codes of the trainer protocol (``docs/protocol.md``)."""

    BAD_FRAME = 1
    FRAME_TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    OUT_OF_ORDER = 4
    INVALID_ARGUMENT = 5
    NO_SUCH_DATASET = 10
    NO_DATASET = 11
    NOT_FOUND = 12
    FORBIDDEN_PATH = 13
    IO_ERROR = 14
    BAD_PLAN = 15
    PLAN_CONFLICT = 16
    NO_PLAN = 17
    TOO_LARGE = 18
    UNAVAILABLE = 19
    BAD_RELEASE = 20
    CLAIM_REFUSED = 21


class SluiceError(Exception):
    """An error reported by the stage, or detected by the client.

    Attributes:
        code: the protocol error code (an :class:`ErrorCode` when known, a
            plain ``int`` for a code this client does not know), or ``None``
            for errors the client detected itself.
        code_name: the code's name (``"NOT_FOUND"``), or a name for a
            client-side error (``"CONNECTION_CLOSED"``).
        message: the stage's message, verbatim (or the client's).
        fatal: ``True`` when the connection can no longer be used.
        name: the sample or file name the error is about, when there is one.
    """

    #: Code of the subclass, used by :func:`error_from_code`.
    default_code: Optional[int] = None
    #: Name used when ``code`` is None (client-side errors).
    default_code_name: str = "ERROR"

    def __init__(
        self,
        message: str,
        *,
        code: Optional[int] = None,
        fatal: bool = False,
        name: Optional[str] = None,
    ) -> None:
        if code is None:
            code = self.default_code
        if code is not None:
            try:
                code = ErrorCode(code)
            except ValueError:
                pass
        self.code = code
        self.message = message
        self.fatal = fatal
        self.name = name
        super().__init__(self._render())

    @property
    def code_name(self) -> str:
        """Returns the name of the error code (``"NOT_FOUND"``, ...)."""
        if isinstance(self.code, ErrorCode):
            return self.code.name
        if self.code is None:
            return self.default_code_name
        return f"UNKNOWN_{self.code}"

    def _render(self) -> str:
        where = f" (sample {self.name!r})" if self.name is not None else ""
        fatal = "; the connection is closed" if self.fatal else ""
        return f"{self.code_name}: {self.message}{where}{fatal}"

    def __reduce__(self):
        # Keeps the keyword-only fields when pickled (DataLoader workers send
        # exceptions back to the main process).
        return (_rebuild, (type(self), self.message, self.code, self.fatal, self.name))


def _rebuild(cls, message, code, fatal, name):
    return cls(message, code=code, fatal=fatal, name=name)


class BadFrameError(SluiceError):
    """The stage could not parse a frame this client sent (a client bug)."""

    default_code = ErrorCode.BAD_FRAME


class FrameTooLargeError(SluiceError):
    """A request frame was over the stage's limit (16 MiB)."""

    default_code = ErrorCode.FRAME_TOO_LARGE


class UnsupportedVersionError(SluiceError):
    """The stage does not speak this client's protocol version."""

    default_code = ErrorCode.UNSUPPORTED_VERSION


class OutOfOrderError(SluiceError):
    """A request came before ``HELLO``, or ``HELLO`` came twice."""

    default_code = ErrorCode.OUT_OF_ORDER


class InvalidArgumentError(SluiceError, ValueError):
    """A request field had an impossible value (job name, rank, limit)."""

    default_code = ErrorCode.INVALID_ARGUMENT


class NoSuchDatasetError(SluiceError, LookupError):
    """The stage serves no dataset by that name."""

    default_code = ErrorCode.NO_SUCH_DATASET


class NoDatasetError(SluiceError):
    """The request needs an open dataset: call ``client.dataset(name)`` first."""

    default_code = ErrorCode.NO_DATASET


class NotFoundError(SluiceError, LookupError):
    """No such file in the dataset (or an index out of range)."""

    default_code = ErrorCode.NOT_FOUND


class ForbiddenPathError(SluiceError):
    """The name leaves the dataset root (``..``, absolute, escaping symlink)."""

    default_code = ErrorCode.FORBIDDEN_PATH


class SluiceIOError(SluiceError):
    """The stage's storage read failed; the message says how."""

    default_code = ErrorCode.IO_ERROR


class BadPlanError(SluiceError, ValueError):
    """The plan is invalid (index out of range, listing changed, unknown kind)."""

    default_code = ErrorCode.BAD_PLAN


class PlanConflictError(SluiceError):
    """A different plan is active under the same (job, data set, rank, epoch, run)."""

    default_code = ErrorCode.PLAN_CONFLICT


class NoPlanError(SluiceError):
    """``NEXT`` was sent before a plan was submitted."""

    default_code = ErrorCode.NO_PLAN


class TooLargeError(SluiceError):
    """The file is larger than one response frame: read it in ranges."""

    default_code = ErrorCode.TOO_LARGE


class UnavailableError(SluiceError):
    """The stage is shutting down."""

    default_code = ErrorCode.UNAVAILABLE


class BadReleaseError(SluiceError):
    """The client returned a shared-memory slot it did not hold (a client
    bug); the connection is closed."""

    default_code = ErrorCode.BAD_RELEASE


class ClaimRefusedError(SluiceError, PermissionError):
    """The stage's rules do not let this trainer (its uid and gid on a UNIX
    socket, or TCP) claim the job or a label it named in ``HELLO``; the
    message says which. The connection is closed."""

    default_code = ErrorCode.CLAIM_REFUSED


class ConnectionClosedError(SluiceError, ConnectionError):
    """The connection to the stage closed (or failed) unexpectedly."""

    default_code_name = "CONNECTION_CLOSED"


class ProtocolError(SluiceError):
    """The stage sent something this client cannot parse, or a frame that
    does not answer the request; the connection is closed."""

    default_code_name = "PROTOCOL_ERROR"


class StageTimeoutError(SluiceError, TimeoutError):
    """No answer came within the client's ``timeout``; the connection is closed
    (a late answer could not be matched to its request any more)."""

    default_code_name = "TIMEOUT"


_BY_CODE = {
    cls.default_code: cls
    for cls in (
        BadFrameError,
        FrameTooLargeError,
        UnsupportedVersionError,
        OutOfOrderError,
        InvalidArgumentError,
        NoSuchDatasetError,
        NoDatasetError,
        NotFoundError,
        ForbiddenPathError,
        SluiceIOError,
        BadPlanError,
        PlanConflictError,
        NoPlanError,
        TooLargeError,
        UnavailableError,
        BadReleaseError,
        ClaimRefusedError,
    )
}


def error_from_code(
    code: int, message: str, *, fatal: bool = False, name: Optional[str] = None
) -> SluiceError:
    """Returns the :class:`SluiceError` subclass instance for a protocol code.

    Unknown codes give a plain :class:`SluiceError` whose ``code`` is the int.
    """
    cls = _BY_CODE.get(code, SluiceError)
    return cls(message, code=code, fatal=fatal, name=name)
