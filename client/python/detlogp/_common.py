"""Pieces shared by the sync and asyncio clients: targets, channel options,
deadline arithmetic, stream item conversion, the raw health check."""
import itertools
import threading
import time

from detlogp import requests
from detlogp.errors import DeadlineExceeded
from detlogp.retry import RetryPolicy
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

HEALTH_METHOD = "/grpc.health.v1.Health/Check"
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def normalize_targets(targets):
    """One "host:port" string or a non-empty sequence of them -> list."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",") if t]
    targets = list(targets)
    if not targets:
        raise ValueError("at least one target (host:port) is needed")
    return targets


def channel_options(max_message_mb):
    size = int(max_message_mb) << 20
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
    ]


class RoundRobin:
    """Thread-safe cycling index over n targets."""

    def __init__(self, n):
        self._n = n
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def next(self):
        with self._lock:
            return next(self._counter) % self._n


class Deadline:
    """An absolute deadline from a timeout in seconds (None: no deadline)."""

    def __init__(self, timeout):
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self):
        """Seconds left (None without a deadline); raises DeadlineExceeded
        once it has passed."""
        if self._end is None:
            return None
        left = self._end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline passed on the client before the call")
        return left

    def allows_sleep(self, seconds):
        return self._end is None or time.monotonic() + seconds < self._end


def stream_item_to_request(item, index):
    """A StreamLogProbs item: a LogProbRequest, a (hidden, targets) tuple, or
    a dict of logprob_request's keyword arguments."""
    if isinstance(item, pb.LogProbRequest):
        return item
    if isinstance(item, dict):
        kwargs = dict(item)
        kwargs.setdefault("request_id", str(index))
        return requests.logprob_request(**kwargs)
    hidden, targets = item
    return requests.logprob_request(hidden, targets, request_id=str(index))


def parse_health_response(data):
    """Decodes grpc.health.v1.HealthCheckResponse {status = 1 (enum)} without
    the grpcio-health-checking package."""
    if not data:
        return _HEALTH_STATUS[0]
    if data[0] != 0x08:
        return "UNKNOWN"
    value, shift = 0, 0
    for byte in data[1:]:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return _HEALTH_STATUS.get(value, str(value))


def identity(data):
    return data


class ClientState:
    """What the sync and asyncio clients share: their constructor, targets,
    channels made by the subclass's `_make_channel` (sync or asyncio), stubs
    per target, the round-robin cursor and retry counters."""

    def __init__(self, targets, *, timeout=30.0, retry=RetryPolicy(),
                 max_message_mb=256, channel_args=(), token=None,
                 root_certificates=None, client_certificate=None,
                 client_key=None):
        self.targets = normalize_targets(targets)
        self.timeout = timeout
        self.retry = retry
        options = channel_options(max_message_mb) + list(channel_args)
        self._channels = [
            self._make_channel(t, options, token=token,
                         root_certificates=root_certificates,
                         client_certificate=client_certificate,
                         client_key=client_key)
            for t in self.targets]
        self._logp = [pb_grpc.LogProbServiceStub(c) for c in self._channels]
        self._proj = [pb_grpc.ProjectionServiceStub(c) for c in self._channels]
        self._health = [c.unary_unary(HEALTH_METHOD, request_serializer=identity,
                                      response_deserializer=identity)
                        for c in self._channels]
        self._rr = RoundRobin(len(self.targets))
        self.attempts = 0  # calls sent, retries included
        self.retries = 0
