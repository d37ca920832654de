"""The details a detlogp server attaches to every non-OK status (gRPC's
richer error model): a google.rpc.Status in the "grpc-status-details-bin"
trailer, holding an ErrorInfo (a stable reason and its metadata), a
BadRequest naming the field, and a RetryInfo where a retry can succeed.

Decoded here from the wire format, so the client needs no googleapis
package. The reasons are listed in docs/api.md ("Errors").
"""

import dataclasses
from typing import Dict, List, Optional

from detlogp.wire import iter_fields

TRAILER = "grpc-status-details-bin"
_TYPE_PREFIX = "type.googleapis.com/"
_ERROR_INFO = _TYPE_PREFIX + "google.rpc.ErrorInfo"
_RETRY_INFO = _TYPE_PREFIX + "google.rpc.RetryInfo"
_BAD_REQUEST = _TYPE_PREFIX + "google.rpc.BadRequest"


@dataclasses.dataclass
class StatusDetails:
    """What a status's details say; empty parts were not said."""

    reason: Optional[str] = None
    domain: Optional[str] = None
    metadata: Dict[str, str] = dataclasses.field(default_factory=dict)
    fields: List[str] = dataclasses.field(default_factory=list)
    retry_delay_s: Optional[float] = None


def _text(value):
    return bytes(value).decode("utf-8", errors="replace")


def _decode_error_info(data, details):
    for field, _, value in iter_fields(data):
        if field == 1:
            details.reason = _text(value)
        elif field == 2:
            details.domain = _text(value)
        elif field == 3:
            entry = {number: _text(item) for number, _, item in iter_fields(value)}
            details.metadata[entry.get(1, "")] = entry.get(2, "")


def _decode_retry_info(data, details):
    for field, _, value in iter_fields(data):
        if field == 1:
            parts = {number: item for number, _, item in iter_fields(value)}
            details.retry_delay_s = parts.get(1, 0) + parts.get(2, 0) / 1e9


def _decode_bad_request(data, details):
    for field, _, value in iter_fields(data):
        if field == 1:
            for number, _, item in iter_fields(value):
                if number == 1:
                    details.fields.append(_text(item))


_DECODERS = {
    _ERROR_INFO: _decode_error_info,
    _RETRY_INFO: _decode_retry_info,
    _BAD_REQUEST: _decode_bad_request,
}


def decode(data):
    """StatusDetails from a serialized google.rpc.Status; empty details for
    no bytes or bytes that are not one."""
    details = StatusDetails()
    if not data:
        return details
    try:
        for field, _, value in iter_fields(data):
            if field != 3:
                continue
            any_parts = {number: item for number, _, item in iter_fields(value)}
            decoder = _DECODERS.get(_text(any_parts.get(1, b"")))
            if decoder is not None:
                decoder(any_parts.get(2, b""), details)
    except ValueError:
        return StatusDetails()
    return details


def from_trailing_metadata(metadata):
    """StatusDetails from a call's trailing metadata (pairs or a Metadata)."""
    for key, value in metadata or ():
        if key == TRAILER:
            return decode(value)
    return StatusDetails()
