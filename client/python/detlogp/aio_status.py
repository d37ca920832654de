"""The status a server ended an asyncio client-streaming call with.

grpcio's asyncio calls lose it when the server ends the call while the
client is still writing (grpc/grpc#36066): the write that fails then sets
the call's status to INTERNAL "Internal error from Core", over the status the
server sent. Servers end such calls early by design: a refused upload (wrong
token, bad header, a version number taken) or a stream whose item is invalid.
The sync API and the C++ client report the server's status.
"""

import grpc
import grpc.aio

# What grpcio's failed write reports in place of the server's status.
_LOST_STATUS_DETAILS = "Internal error from Core"
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class ServerStatus:
    """Watches an asyncio call; `error` is the first non-OK status the server
    sent (an AioRpcError), or None. A call's done callbacks run each time its
    status is set, so the server's status is seen before any write replaces
    it, and again when it arrives after the failed write's."""

    def __init__(self, call):
        self.error = None
        call.add_done_callback(self._seen)

    def _seen(self, call):
        # grpcio keeps the status only on its Cython call object; without it
        # (another grpcio), the call's own status is reported as before.
        status = getattr(getattr(call, "_cython_call", None), "_status", None)
        if self.error is not None or status is None:
            return
        code = _STATUS_CODES.get(status.code(), grpc.StatusCode.UNKNOWN)
        if code == grpc.StatusCode.OK or (
            code == grpc.StatusCode.INTERNAL and status.details() == _LOST_STATUS_DETAILS
        ):
            return
        self.error = grpc.aio.AioRpcError(
            code,
            grpc.aio.Metadata(),
            grpc.aio.Metadata.from_tuple(status.trailing_metadata() or ()),
            details=status.details(),
            debug_error_string=status.debug_error_string(),
        )
