"""detlogp: Python client for the deterministic log-probability service.

    Client / aio.AsyncClient   sync and asyncio clients (round-robin, retries)
    RetryPolicy                backoff with jitter for UNAVAILABLE / queue full
    DetlogpError and subclasses  typed errors carrying the server's message
    LogProbResult, ProjectResult  numpy results
"""
from detlogp.client import Client
from detlogp.errors import (Cancelled, DeadlineExceeded, DetlogpError,
                            InvalidArgument, Overloaded, Unavailable,
                            Unauthenticated, Unimplemented)
from detlogp.results import LogProbResult, ProjectResult
from detlogp.retry import NO_RETRY, RetryPolicy
from detlogp import aio  # noqa: E402  (detlogp.aio.AsyncClient)

__all__ = [
    "Client", "aio", "RetryPolicy", "NO_RETRY", "LogProbResult",
    "ProjectResult", "DetlogpError", "InvalidArgument", "Overloaded",
    "DeadlineExceeded", "Unavailable", "Cancelled", "Unauthenticated",
    "Unimplemented",
]
__version__ = "0.1.0"
