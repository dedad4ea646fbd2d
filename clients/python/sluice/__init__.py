"""sluice: the trainer client of the sluice storage layer.

Trainers read samples through a ``sluice-stage``, which prefetches each
epoch's samples in plan order into a bounded memory buffer::

    import sluice

    with sluice.Client("/run/sluice/stage.sock", job="resnet50",
                       rank=rank, world_size=world_size) as client:
        ds = client.dataset("imagenet")
        for epoch in range(epochs):
            for name, data in ds.epoch(epoch, seed=1234):
                ...

Only the standard library is used. PyTorch adapters live in
:mod:`sluice.torch` (imported on demand); the wire protocol is in
:mod:`sluice.protocol` and the plan derivation in :mod:`sluice.plan`.
"""

from .client import Client, Dataset, FileList, PlanIterator, parse_address
from .errors import (
    BadFrameError,
    BadPlanError,
    BadReleaseError,
    ClaimRefusedError,
    ConnectionClosedError,
    ErrorCode,
    ForbiddenPathError,
    FrameTooLargeError,
    InvalidArgumentError,
    NoDatasetError,
    NoPlanError,
    NoSuchDatasetError,
    NotFoundError,
    OutOfOrderError,
    PlanConflictError,
    ProtocolError,
    SluiceError,
    SluiceIOError,
    StageTimeoutError,
    TooLargeError,
    UnavailableError,
    UnsupportedVersionError,
)
from .iterator import AlreadyReadWarning, SupersededError
from .plan import shuffle_plan
from .protocol import PlanState

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Dataset",
    "FileList",
    "PlanIterator",
    "SupersededError",
    "AlreadyReadWarning",
    "PlanState",
    "parse_address",
    "shuffle_plan",
    "ErrorCode",
    "SluiceError",
    "BadFrameError",
    "BadPlanError",
    "BadReleaseError",
    "ClaimRefusedError",
    "ConnectionClosedError",
    "ForbiddenPathError",
    "FrameTooLargeError",
    "InvalidArgumentError",
    "NoDatasetError",
    "NoPlanError",
    "NoSuchDatasetError",
    "NotFoundError",
    "OutOfOrderError",
    "PlanConflictError",
    "ProtocolError",
    "SluiceIOError",
    "StageTimeoutError",
    "TooLargeError",
    "UnavailableError",
    "UnsupportedVersionError",
]
