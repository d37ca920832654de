"""Typed exceptions for detlogp calls, each carrying the server's message.

`from_rpc_error` maps a grpc.RpcError (sync or aio) to the matching subclass:

    INVALID_ARGUMENT    -> InvalidArgument  (.field: "hidden.shape[1]", ...)
    RESOURCE_EXHAUSTED  -> Overloaded       (.queue_full: server queue bound),
                           or MessageTooLarge (.limit_bytes: a size limit)
    DEADLINE_EXCEEDED   -> DeadlineExceeded
    UNAVAILABLE         -> Unavailable
    CANCELLED           -> Cancelled
    UNIMPLEMENTED       -> Unimplemented
    UNAUTHENTICATED     -> Unauthenticated
    PERMISSION_DENIED   -> PermissionDenied (.field: "path", ...)
    NOT_FOUND           -> NotFound         (.field: "model", "model_version")
    DATA_LOSS           -> DataLoss         (.field: "weights_sha256")
    FAILED_PRECONDITION -> FailedPrecondition (.field: "header.model_version")
    anything else       -> DetlogpError

A message over a size limit (gRPC's "Sent message larger than max" on the
client, "Received message larger than max" on the server) is
MessageTooLarge, never Overloaded: .limit_bytes names the limit.

ReplicaMismatch is raised by the client itself when replicas that were
given the same weights answer with different determinism keys or versions.
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


_FIELD = re.compile(r"^([A-Za-z_][\w.]*(?:\[\d+\])?(?:\.\w+)*):")


def _field_of(details):
    match = _FIELD.match(details or "")
    return match.group(1) if match else None


class InvalidArgument(DetlogpError):
    """The request was malformed. `field` names the offending field as the
    server reported it (e.g. "target_ids[3]", "header.shape"), or None if it
    named none."""

    def __init__(self, details, code=grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(details, code)
        self.field = _field_of(details)


class NotFound(DetlogpError):
    """NOT_FOUND: no such model ("model") or no ready version of it
    ("model_version"), or a LoadModel path that does not exist ("path").
    `field` names what the server could not find."""

    def __init__(self, details, code=grpc.StatusCode.NOT_FOUND):
        super().__init__(details, code)
        self.field = _field_of(details)


class Overloaded(DetlogpError):
    """RESOURCE_EXHAUSTED. `queue_full` is True when the server's row queue
    was full (retryable); False for other exhaustion (not retryable). A
    message over a size limit is MessageTooLarge instead."""

    def __init__(self, details, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
        super().__init__(details, code)
        self.queue_full = (details or "").startswith("queue full")


class MessageTooLarge(DetlogpError):
    """A message over a size limit: the server's --max_message_mb or the
    client's max_message_mb. `size_bytes` and `limit_bytes` as gRPC or the
    client reported them (None when unknown); `on_server`: the server's
    limit. Not retryable; logprobs() cuts large calls so it never sends
    one."""

    def __init__(
        self,
        details,
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        *,
        size_bytes=None,
        limit_bytes=None,
        on_server=False,
    ):
        super().__init__(details, code)
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        self.on_server = on_server


class DeadlineExceeded(DetlogpError):
    """The call's deadline passed (on the client or the server)."""


class Unavailable(DetlogpError):
    """No server answered (down, restarting, draining)."""


class Cancelled(DetlogpError):
    """The call was cancelled."""


class Unimplemented(DetlogpError):
    """The server does not implement this method."""


class Unauthenticated(DetlogpError):
    """The call carried no valid bearer token (or client certificate); for
    ModelRepositoryService calls, no valid admin token."""


class PermissionDenied(DetlogpError):
    """PERMISSION_DENIED: the server refuses the call whoever makes it: a
    LoadModel path that leaves --model_root (absolute, "..", a symlink out;
    `field` is "path"), or admin calls on a server that listens beyond
    loopback without --admin_tokens_file."""

    def __init__(self, details, code=grpc.StatusCode.PERMISSION_DENIED):
        super().__init__(details, code)
        self.field = _field_of(details)


class DataLoss(DetlogpError):
    """DATA_LOSS: the uploaded bytes do not hash to the digest the client
    sent (`field` is "weights_sha256"); nothing was changed on the server."""

    def __init__(self, details, code=grpc.StatusCode.DATA_LOSS):
        super().__init__(details, code)
        self.field = _field_of(details)


class FailedPrecondition(DetlogpError):
    """FAILED_PRECONDITION: LoadModel on a server without --model_root, or an
    explicit version number not above every number the model has had
    (`field` "model_version" or "header.model_version")."""

    def __init__(self, details, code=grpc.StatusCode.FAILED_PRECONDITION):
        super().__init__(details, code)
        self.field = _field_of(details)


class ReplicaMismatch(DetlogpError):
    """Raised by the client (no server status): replicas given the same
    weights answered with different determinism keys (or version numbers),
    so equal requests would not get equal bits on every target. `results`
    maps each target to its ModelVersionStatus; the version IS published on
    every replica that answered."""

    def __init__(self, details, results=None):
        super().__init__(details, None)
        self.results = dict(results or {})


_BY_CODE = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
}


_TOO_LARGE = re.compile(r"(Sent|Received) message larger than max \((\d+) vs\. (\d+)\)")


def from_rpc_error(error):
    """Returns the typed exception for a grpc.RpcError (sync or aio)."""
    code = error.code()
    details = error.details() or ""
    too_large = _TOO_LARGE.search(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and too_large:
        side = (
            "client's max_message_mb"
            if too_large.group(1) == "Sent"
            else ("server's --max_message_mb")
        )
        size, limit = int(too_large.group(2)), int(too_large.group(3))
        return MessageTooLarge(
            f"message of {size} bytes is over the {side} ({limit} bytes): {details}",
            code,
            size_bytes=size,
            limit_bytes=limit,
            on_server=too_large.group(1) == "Received",
        )
    cls = _BY_CODE.get(code, DetlogpError)
    if cls is DetlogpError:
        return DetlogpError(details, code)
    return cls(details, code)
