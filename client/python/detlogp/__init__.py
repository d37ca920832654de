"""detlogp: Python client for the deterministic log-probability service.

Client / aio.AsyncClient   sync and asyncio clients (round-robin, retries)
RetryPolicy                backoff with jitter for UNAVAILABLE / queue full
DetlogpError and subclasses  typed errors carrying the server's message
LogProbResult, ProjectResult, ModelVersionResult  results
LmHead, lm_head_sha256     upload payloads and the model digest (weights)
TransferOptions, CallTimings  which calls go through the C++ engine, and where their time went
"""

from detlogp import aio  # noqa: E402  (detlogp.aio.AsyncClient)
from detlogp.calls import CallTimings, EngineRequired, TransferOptions
from detlogp.client import Client
from detlogp.errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    DetlogpError,
    FailedPrecondition,
    InvalidArgument,
    MessageTooLarge,
    NotFound,
    Overloaded,
    PermissionDenied,
    ReplicaMismatch,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from detlogp.heap import keep_freed_memory
from detlogp.results import LogProbResult, ModelVersionResult, ProjectResult
from detlogp.retry import NO_RETRY, RetryPolicy
from detlogp.weights import LmHead, lm_head_sha256

__all__ = [
    "Client",
    "aio",
    "RetryPolicy",
    "TransferOptions",
    "keep_freed_memory",
    "CallTimings",
    "EngineRequired",
    "NO_RETRY",
    "LogProbResult",
    "ProjectResult",
    "ModelVersionResult",
    "LmHead",
    "lm_head_sha256",
    "DetlogpError",
    "InvalidArgument",
    "Overloaded",
    "MessageTooLarge",
    "DeadlineExceeded",
    "Unavailable",
    "Cancelled",
    "Unauthenticated",
    "Unimplemented",
    "NotFound",
    "PermissionDenied",
    "DataLoss",
    "FailedPrecondition",
    "ReplicaMismatch",
]
__version__ = "0.1.0"
