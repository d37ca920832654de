"""Typed exceptions for detlogp calls, each carrying the server's message.

`from_rpc_error` maps a grpc.RpcError (sync or aio) to the matching subclass:

    INVALID_ARGUMENT    -> InvalidArgument  (.field: "hidden.shape[1]", ...)
    RESOURCE_EXHAUSTED  -> Overloaded       (.queue_full: server queue bound)
    DEADLINE_EXCEEDED   -> DeadlineExceeded
    UNAVAILABLE         -> Unavailable
    CANCELLED           -> Cancelled
    UNIMPLEMENTED       -> Unimplemented
    anything else       -> DetlogpError
"""
import re

import grpc


class DetlogpError(Exception):
    """A failed detlogp call. `code` is the grpc.StatusCode (or None for
    client-side failures), `details` the server's message."""

    def __init__(self, details, code=None):
        super().__init__(f"{code.name}: {details}" if code is not None else details)
        self.code = code
        self.details = details


class InvalidArgument(DetlogpError):
    """The request was malformed. `field` names the offending field as the
    server reported it (e.g. "target_ids[3]"), or None if it named none."""

    _FIELD = re.compile(r"^([A-Za-z_][\w.]*(?:\[\d+\])?(?:\.\w+)*):")

    def __init__(self, details, code=grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(details, code)
        match = self._FIELD.match(details or "")
        self.field = match.group(1) if match else None


class Overloaded(DetlogpError):
    """RESOURCE_EXHAUSTED. `queue_full` is True when the server's row queue
    was full (retryable); False for other exhaustion such as a message over
    the size limit (not retryable)."""

    def __init__(self, details, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
        super().__init__(details, code)
        self.queue_full = (details or "").startswith("queue full")


class DeadlineExceeded(DetlogpError):
    """The call's deadline passed (on the client or the server)."""


class Unavailable(DetlogpError):
    """No server answered (down, restarting, draining)."""


class Cancelled(DetlogpError):
    """The call was cancelled."""


class Unimplemented(DetlogpError):
    """The server does not implement this method."""


class Unauthenticated(DetlogpError):
    """The call carried no valid bearer token (or client certificate)."""


_BY_CODE = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}


def from_rpc_error(error):
    """Returns the typed exception for a grpc.RpcError (sync or aio)."""
    code = error.code()
    details = error.details() or ""
    cls = _BY_CODE.get(code, DetlogpError)
    if cls is DetlogpError:
        return DetlogpError(details, code)
    return cls(details, code)
