"""Typed exceptions for detlogp calls, each carrying the server's message
and its details: `reason` (a stable ErrorInfo reason such as "QUEUE_FULL",
"ROWS_OVER_LIMIT", "INVALID_FIELD"; docs/api.md lists them), `field` (the
request field the server named), `limit` and `metadata`, and
`retry_delay_s` when a retry can succeed. They come from the status
details (status_details.py), never from the message text.

`from_rpc_error` maps a grpc.RpcError (sync or aio) to the matching subclass:

    INVALID_ARGUMENT    -> InvalidArgument  (.field: "hidden.shape[1]", ...)
    RESOURCE_EXHAUSTED  -> Overloaded       (.queue_full: reason QUEUE_FULL),
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
MessageTooLarge, never Overloaded: .limit_bytes names the limit. gRPC
itself refuses such messages, with no details: this is the one error read
from its text (reason MESSAGE_TOO_LARGE).

ReplicaMismatch is raised by the client itself when replicas that were
given the same weights answer with different determinism keys or versions.
"""

import re

import grpc

from detlogp import status_details as _details


class DetlogpError(Exception):
    """A failed detlogp call. `code` is the grpc.StatusCode (or None for
    client-side failures), `details` the server's message; `reason`,
    `field`, `fields`, `limit`, `metadata` and `retry_delay_s` what the
    status details say (None or empty where they say nothing)."""

    default_code = None

    def __init__(self, details, code=None, *, status_details=None, field=None):
        code = code if code is not None else self.default_code
        super().__init__(f"{code.name}: {details}" if code is not None else details)
        self.code = code
        self.details = details
        said = status_details or _details.StatusDetails(fields=[field] if field else [])
        self.status_details = said
        self.reason = said.reason or (code.name if code is not None else None)
        self.metadata = dict(said.metadata)
        self.fields = list(said.fields)
        self.field = said.fields[0] if said.fields else None
        self.retry_delay_s = said.retry_delay_s
        try:
            self.limit = int(said.metadata["limit"]) if "limit" in said.metadata else None
        except ValueError:
            self.limit = None


class InvalidArgument(DetlogpError):
    """The request was malformed. `field` names the offending field as the
    server reported it (e.g. "target_ids[3]", "header.shape"), or None if it
    named none."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(DetlogpError):
    """NOT_FOUND: no such model ("model") or no ready version of it
    ("model_version"), or a LoadModel path that does not exist ("path").
    `field` names what the server could not find."""

    default_code = grpc.StatusCode.NOT_FOUND


class Overloaded(DetlogpError):
    """RESOURCE_EXHAUSTED. `queue_full` is True when the server's row queue
    was full (retryable); False for other exhaustion (not retryable). A
    message over a size limit is MessageTooLarge instead."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def queue_full(self):
        return self.reason == "QUEUE_FULL"


class MessageTooLarge(DetlogpError):
    """A message over a size limit: the server's --max_message_mb or the
    client's max_message_mb. `size_bytes` and `limit_bytes` as gRPC or the
    client reported them (None when unknown); `on_server`: the server's
    limit. Not retryable; logprobs() cuts large calls so it never sends
    one."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(
        self,
        details,
        code=None,
        *,
        size_bytes=None,
        limit_bytes=None,
        on_server=False,
    ):
        super().__init__(
            details, code, status_details=_details.StatusDetails(reason="MESSAGE_TOO_LARGE")
        )
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        self.on_server = on_server


class DeadlineExceeded(DetlogpError):
    """The call's deadline passed (on the client or the server)."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(DetlogpError):
    """No server answered (down, restarting, draining)."""

    default_code = grpc.StatusCode.UNAVAILABLE


class Cancelled(DetlogpError):
    """The call was cancelled."""

    default_code = grpc.StatusCode.CANCELLED


class Unimplemented(DetlogpError):
    """The server does not implement this method."""

    default_code = grpc.StatusCode.UNIMPLEMENTED


class Unauthenticated(DetlogpError):
    """The call carried no valid bearer token (or client certificate); for
    ModelRepositoryService calls, no valid admin token."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(DetlogpError):
    """PERMISSION_DENIED: the server refuses the call whoever makes it: a
    LoadModel path that leaves --model_root (absolute, "..", a symlink out;
    `field` is "path"), or admin calls on a server that listens beyond
    loopback without --admin_tokens_file."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class DataLoss(DetlogpError):
    """DATA_LOSS: the uploaded bytes do not hash to the digest the client
    sent (`field` is "weights_sha256"); nothing was changed on the server."""

    default_code = grpc.StatusCode.DATA_LOSS


class FailedPrecondition(DetlogpError):
    """FAILED_PRECONDITION: LoadModel on a server without --model_root, or an
    explicit version number not above every number the model has had
    (`field` "model_version" or "header.model_version")."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


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
    try:
        trailers = error.trailing_metadata()
    except Exception:  # an error raised before the call had trailers
        trailers = None
    said = _details.from_trailing_metadata(trailers)
    return _BY_CODE.get(code, DetlogpError)(details, code, status_details=said)


_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def from_status(number, message, serialized_details=None):
    """The typed exception for a status given as its code's number, its
    message and its serialized google.rpc.Status details (the C++
    client's)."""
    code = _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
    said = _details.decode(serialized_details)
    return _BY_CODE.get(code, DetlogpError)(message, code, status_details=said)
