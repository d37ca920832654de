"""Pieces shared by the sync and asyncio clients: targets, channel options,
deadline arithmetic, retry decisions, how a logprobs() call is sent (through
calls.py), stream item conversion, the raw health check, and combining
several replicas' answers to an admin call."""

import collections
import dataclasses
import itertools
import logging
import threading
import time
import weakref

import grpc

from detlogp import calls, engine, requests, wire
from detlogp.credentials import bearer
from detlogp.errors import (
    DataLoss,
    DeadlineExceeded,
    NotFound,
    ReplicaMismatch,
)
from detlogp.results import ModelVersionResult
from detlogp.retry import RetryPolicy, is_retryable, queue_full_delay
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

log = logging.getLogger("detlogp")

HEALTH_METHOD = "/grpc.health.v1.Health/Check"
COMPUTE_METHOD = "/detlogp.v1.LogProbService/ComputeLogProbs"
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
    """No limit on what the client sends (a call larger than the server's
    limit goes through the engine, and a message over it is refused by the
    server as MessageTooLarge); answers up to max_message_mb MiB."""
    return [
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", int(max_message_mb) << 20),
    ]


def wants_round_robin(target):
    """dns:/// names (a Kubernetes headless Service: one address per pod)
    and ipv4:/ipv6: address lists: calls are spread over every address
    (gRPC's round_robin) instead of gRPC's default pick_first, which sends
    everything to one."""
    return target.startswith(("dns:", "ipv4:", "ipv6:"))


def sets_lb_policy(options):
    return any(key in ("grpc.lb_policy_name", "grpc.service_config") for key, _ in options)


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
            raise DeadlineExceeded(
                "deadline passed on the client before the call", grpc.StatusCode.DEADLINE_EXCEEDED
            )
        return left

    def allows_sleep(self, seconds):
        return self._end is None or time.monotonic() + seconds < self._end


class CallPlan:
    """Which target each attempt of one unary call goes to, and whether a
    failed attempt is tried again.

    The first attempt takes the next target round-robin. A retryable error
    (UNAVAILABLE) is retried with backoff within the deadline, on the next
    round-robin target, up to RetryPolicy.max_attempts. A full queue
    (reason QUEUE_FULL) is retried on the same target after the server's
    retry delay with jitter, as often as the deadline allows. With
    `retry_not_found` (a call pinned to an explicit model version), NOT_FOUND
    moves at once to the following target, so a replica that lacks the
    version is skipped; each target is tried at most once that way."""

    def __init__(self, state, timeout, retry_not_found=False):
        self.deadline = Deadline(state.timeout if timeout is None else timeout)
        self._state = state
        self._n = len(state.targets)
        self.index = state._rr.next()
        self._retry_not_found = retry_not_found
        self._failures = 0
        self._not_found = 0

    def after(self, error):
        """None when `error` should be raised; else the seconds to wait
        before the next attempt (self.index is then its target)."""
        if self._retry_not_found and isinstance(error, NotFound):
            self._not_found += 1
            if self._not_found >= self._n:
                return None
            self.index = (self.index + 1) % self._n
            self._state.retries += 1
            return 0.0
        queue_full = queue_full_delay(error)
        if queue_full is not None and self._state.retry.max_attempts > 1:
            # The server said when to come back: retried until the deadline,
            # on the same target (another one's queue says nothing of it).
            if not self.deadline.allows_sleep(queue_full):
                return None
            self._state.retries += 1
            return queue_full
        self._failures += 1
        policy = self._state.retry
        if not is_retryable(error) or self._failures >= policy.max_attempts:
            return None
        pause = policy.backoff(self._failures - 1)
        if not self.deadline.allows_sleep(pause):
            return None
        self.index = self._state._rr.next()
        self._state.retries += 1
        return pause


def logprob_fields(
    request_id, temperature, return_lse, model, version, return_entropy, top_k, timing
):
    """logprobs()' arguments as wire.RequestFields (top_k checked as
    requests.top_k_value does)."""
    return wire.RequestFields(
        request_id=request_id or "",
        temperature=float(temperature),
        return_lse=bool(return_lse),
        model=model or "",
        model_version=int(version or 0),
        return_entropy=bool(return_entropy),
        top_k=requests.top_k_value(top_k),
        return_timing=bool(timing),
    )


# How long after an unanswered ModelInfo the client asks a target for its
# limits again.
LIMITS_ASK_AGAIN_S = 10.0


def stream_item_to_request(item, index, model=None, version=None):
    """A StreamLogProbs item: a LogProbRequest, a (hidden, targets) tuple, or
    a dict of logprob_request's keyword arguments. `model` and `version`
    apply to items that do not name their own."""
    if isinstance(item, pb.LogProbRequest):
        if (model and not item.model) or (version and not item.model_version):
            request = pb.LogProbRequest()
            request.CopyFrom(item)  # the caller's message stays as it was
            request.model = item.model or model or ""
            request.model_version = item.model_version or int(version or 0)
            return request
        return item
    if isinstance(item, dict):
        kwargs = dict(item)
        kwargs.setdefault("request_id", str(index))
        if kwargs.get("model") is None:
            kwargs["model"] = model
        if kwargs.get("version") is None:
            kwargs["version"] = version
        return requests.logprob_request(**kwargs)
    hidden, targets = item
    return requests.logprob_request(
        hidden, targets, request_id=str(index), model=model, version=version
    )


class SentRequests:
    """The requests of one stream, in the order they were sent, so that each
    answer (in the same order) is checked against its own request. Filled by
    the thread or task that feeds the stream, drained by the reader; an
    answer never arrives before its request was sent.

    `failure` is the exception that stopped the feeding (an item that could
    not be made a request, e.g. a negative top_k): gRPC only cancels the
    call then, and the reader raises this instead of the cancellation."""

    def __init__(self):
        self._queue = collections.deque()
        self.failure = None

    def add(self, request):
        self._queue.append(request)
        return request

    def feed(self, items, model=None, version=None):
        """The requests for `items` (stream_item_to_request), each recorded."""
        try:
            for index, item in enumerate(items):
                yield self.add(stream_item_to_request(item, index, model, version))
        except Exception as error:
            self.failure = error
            raise

    async def feed_async(self, items, model=None, version=None):
        """feed() for a plain or an async iterable of items."""
        try:
            if hasattr(items, "__aiter__"):
                index = 0
                async for item in items:
                    yield self.add(stream_item_to_request(item, index, model, version))
                    index += 1
            else:
                for index, item in enumerate(items):
                    yield self.add(stream_item_to_request(item, index, model, version))
        except Exception as error:
            self.failure = error
            raise

    def answered(self):
        """The request the next answer belongs to."""
        if not self._queue:
            raise DataLoss("stream: an answer arrived for no outstanding request")
        return self._queue.popleft()


def legacy_info_args(model, timeout):
    """info(5.0) meant info(timeout=5.0) before models had names."""
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return None, model if timeout is None else timeout
    return model, timeout


def combine_versions(model, per_target):
    """One ModelVersionResult from {target: ModelVersionStatus}; raises
    ReplicaMismatch when the targets disagree on the determinism key, the
    digest or the version number (a version pinned by number would then
    mean different weights on different replicas)."""
    statuses = list(per_target.values())
    first = statuses[0]
    for what in ("determinism_key", "weights_sha256", "version"):
        values = {target: getattr(status, what) for target, status in per_target.items()}
        if len(set(values.values())) > 1:
            listed = ", ".join(f"{t}: {v}" for t, v in values.items())
            hint = (
                "; pass version= to publish it under one number everywhere"
                if what == "version"
                else ""
            )
            raise ReplicaMismatch(
                f"model '{model}': the targets answered with different {what}s "
                f"({listed}); each published its version, but equal requests "
                "will not get equal bits (or the same version number) "
                f"everywhere{hint}",
                per_target,
            )
    return ModelVersionResult(
        model=model,
        version=int(first.version),
        weights_sha256=first.weights_sha256,
        determinism_key=first.determinism_key,
        per_target=dict(per_target),
    )


def first_failure(model, action, outcomes):
    """Of {target: status or exception}, the first exception, annotated with
    every target's outcome (`.per_target`), or None when all succeeded."""
    for target, outcome in outcomes.items():
        if isinstance(outcome, BaseException):
            outcome.per_target = dict(outcomes)
            if len(outcomes) > 1:
                done = [t for t, o in outcomes.items() if not isinstance(o, BaseException)]
                outcome.args = (
                    f"{outcome.args[0] if outcome.args else outcome} "
                    f"[{action} of '{model}' on {target}; succeeded on: "
                    f"{', '.join(done) or 'none'}]",
                )
            return outcome
    return None


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

    # Whether the channel adds the scoring token to each call (else the
    # subclass sends `_scoring_metadata` with each call itself).
    _channel_sends_token = True

    def __init__(
        self,
        targets,
        *,
        timeout=30.0,
        retry=RetryPolicy(),
        max_message_mb=256,
        channel_args=(),
        token=None,
        root_certificates=None,
        client_certificate=None,
        client_key=None,
        admin_token=None,
        admin_timeout=600.0,
        transfer_options=None,
        shared_memory=None,
    ):
        self.targets = normalize_targets(targets)
        options = transfer_options or calls.TransferOptions()
        if shared_memory is not None:
            options = dataclasses.replace(options, shared_memory=shared_memory)
        self.transfer_options = options.validated()
        self._max_receive_bytes = int(max_message_mb) << 20
        self.timeout = timeout
        self.retry = retry
        self.admin_timeout = admin_timeout
        # Admin calls carry the admin token as their only bearer token (the
        # channel's scoring token is then left off).
        self._admin_metadata = bearer(admin_token) if admin_token else None
        self._scoring_metadata = bearer(token) if token else None
        self._channel_options = channel_options(max_message_mb) + list(channel_args)
        self._channel_security = dict(
            root_certificates=root_certificates,
            client_certificate=client_certificate,
            client_key=client_key,
        )
        # What a sync channel to a target needs (the asyncio client releases
        # its regions at exit through one).
        self._sync_channel_security = dict(self._channel_security, token=token)
        if self._channel_sends_token:
            self._channel_security["token"] = token
        self._channels = [self._own_channel(t, own_connection=False) for t in self.targets]
        self._logp = [pb_grpc.LogProbServiceStub(c) for c in self._channels]
        self._proj = [pb_grpc.ProjectionServiceStub(c) for c in self._channels]
        self._repo = [pb_grpc.ModelRepositoryServiceStub(c) for c in self._channels]
        self._health = [
            c.unary_unary(
                HEALTH_METHOD, request_serializer=identity, response_deserializer=identity
            )
            for c in self._channels
        ]
        self._rr = RoundRobin(len(self.targets))
        self.attempts = 0  # calls sent, retries included
        self.retries = 0
        # logprobs(): one request's ComputeLogProbs per target (serialized
        # messages, wire.py), each target's limits once known, and the C++
        # engine for larger calls.
        self._compute_raw = [self._raw_compute(c) for c in self._channels]
        self._limits_lock = threading.Lock()
        # Held by the call asking for limits: calls meanwhile wait for them
        # (a path is chosen from known limits; a target that does not
        # answer is taken to have the server's defaults).
        self._asking_lock = threading.Lock()
        self._limits = [None] * len(self.targets)
        self._limits_asked = [None] * len(self.targets)  # monotonic time
        self._engine, self._engine_refusal = self._make_engine(list(channel_args))
        # Whether any target may get rows through the engine's regions, and
        # whether a refusal of them was logged (once per client).
        self._regions_wanted = any(options.regions_for(self.targets[0]))
        self._refusal_logged = False
        # Regions are released by close(), or at exit when it was not called.
        self._close_engine = weakref.finalize(self, _close, self._engine)

    # The detlogp.fleet.Pusher of the client's uploads, made on first use.
    _fleet_pusher = None

    def _pusher(self, channels=None, metadata=None):
        """The client's Pusher (made once; it keeps the version it pushed
        last as the next delta's base): on `channels`, sync channels of the
        client's, or on its own made with the client's TLS options (always
        its own, one per address, for a dns: target); `metadata` sent on
        every call."""
        if self._fleet_pusher is None:
            from detlogp.fleet import Pusher

            security = {k: v for k, v in self._sync_channel_security.items() if k != "token"}
            token = self._sync_channel_security.get("token")
            if metadata is None and token:
                # The client's channels carry its token; the channels the
                # pusher makes for a dns: name's addresses do not.
                metadata = bearer(token)
            self._fleet_pusher = Pusher(
                self.targets,
                timeout=self.admin_timeout or 600.0,
                _channels=channels,
                _metadata=metadata,
                **security,
            )
        return self._fleet_pusher

    def _make_engine(self, channel_args):
        """(the engine over every target, None) or (None, why there is
        none)."""
        options = self.transfer_options
        if options.native_transport == "off":
            return None, "TransferOptions.native_transport='off'"
        try:
            lib = engine.load_library()
        except RuntimeError as why:
            if options.native_transport == "on":
                raise RuntimeError(f"TransferOptions.native_transport='on': {why}") from None
            log.info("calls larger than one request need the C++ engine: %s", why)
            return None, str(why)
        # The engine's regions are registered with its first target.
        system, cuda = options.regions_for(self.targets[0])
        settings = engine.EngineSettings(
            targets=tuple(self.targets),
            timeout=self.timeout,
            max_message_bytes=self._max_receive_bytes,
            connections=options.connections,
            request_bytes=options.slice_bytes,
            requests_in_flight=options.slices_in_flight_per_connection,
            region_piece_bytes=options.region_piece_bytes or 0,
            system_shared_memory=system,
            cuda_shared_memory=cuda,
            channel_args=tuple(channel_args),
            security=self._sync_channel_security,
        )
        try:
            return engine.Engine(lib, settings), None
        except engine.EngineUnusable as why:
            if options.native_transport == "on":
                raise
            log.info("calls larger than one request need the C++ engine: %s", why)
            return None, str(why)

    # ------------------------------------------------------------ logprobs
    def _new_call(self, hidden, targets, fields, timing):
        """(calls.LogProbCall, CallTimings or None, its start time)."""
        started = time.perf_counter()
        call = calls.LogProbCall(hidden, targets, fields)
        timings = None
        if timing:
            timings = calls.CallTimings(prepare_s=time.perf_counter() - started)
        return call, timings, started

    def _needs_limits(self, call):
        """Whether the targets' limits may have to be asked to choose the
        call's path (a call of one row always fits)."""
        return call.well_formed and call.rows > 1 and any(k is None for k in self._limits)

    def _route(self, call):
        """calls.GRPCIO or calls.ENGINE for `call` (calls.choose_route);
        EngineRequired says why there is no engine."""
        try:
            return calls.choose_route(
                call,
                calls.ServerLimits.tightest(self._limits),
                self.transfer_options,
                self._max_receive_bytes,
                self._engine is not None,
                self.targets[0],
            )
        except calls.EngineRequired as error:
            raise calls.EngineRequired(f"{error}; here: {self._engine_refusal}") from None

    def _after_engine(self, result):
        """`result`, a region's refusal logged once per client (the result's
        path says where the rows went)."""
        if self._regions_wanted and not self._refusal_logged:
            why = self._engine.shared_memory_refusal()
            if why:
                self._refusal_logged = True
                log.warning("the server refused the engine's shared memory: %s", why)
        return result

    def _close_engine_now(self):
        self._close_engine()

    def _targets_to_ask_limits(self):
        """Targets whose limits are unknown and were not asked for lately
        (a target that did not answer is asked again LIMITS_ASK_AGAIN_S
        later; meanwhile it is taken to have the server's defaults)."""
        now = time.monotonic()
        due = []
        with self._limits_lock:
            for index, known in enumerate(self._limits):
                asked = self._limits_asked[index]
                if known is None and (asked is None or now - asked > LIMITS_ASK_AGAIN_S):
                    self._limits_asked[index] = now
                    due.append(index)
        return due

    @staticmethod
    def _raw_compute(channel):
        """ComputeLogProbs taking and giving serialized messages (wire.py
        writes and reads them)."""
        return channel.unary_unary(
            COMPUTE_METHOD, request_serializer=identity, response_deserializer=identity
        )

    def _own_channel(self, target, own_connection=True):
        """A channel to `target` as the client's are made; with
        own_connection, on a TCP connection of its own."""
        options = list(self._channel_options)
        if wants_round_robin(target) and not sets_lb_policy(options):
            options.append(("grpc.lb_policy_name", "round_robin"))
        if own_connection:
            options.append(("grpc.use_local_subchannel_pool", 1))
        return self._make_channel(target, options, **self._channel_security)

    def _admin_timeout(self, timeout):
        return self.admin_timeout if timeout is None else timeout


def _close(made):
    if made is not None:
        made.close()
