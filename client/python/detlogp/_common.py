"""Pieces shared by the sync and asyncio clients: targets, channel options,
deadline arithmetic, retry decisions, stream item conversion, the raw
health check, and combining several replicas' answers to an admin call."""

import collections
import dataclasses
import itertools
import logging
import threading
import time

import grpc

from detlogp import native, requests, shm, transfer, wire
from detlogp.credentials import bearer
from detlogp.errors import (
    DataLoss,
    DeadlineExceeded,
    DetlogpError,
    MessageTooLarge,
    NotFound,
    ReplicaMismatch,
)
from detlogp.results import ModelVersionResult
from detlogp.retry import RetryPolicy, is_retryable, queue_full_delay
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

log = logging.getLogger("detlogp")
# What staging rows in shared memory may raise that means "use gRPC bytes".
STAGING_FAILURES = (DetlogpError, OSError, MemoryError, ImportError, RuntimeError)

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
    """No limit on what the client sends (logprobs() cuts calls to fit the
    server's limit, and a message over it is refused by the server as
    MessageTooLarge); answers up to max_message_mb MiB (logprobs() cuts
    calls so that theirs fit too)."""
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
# The field the server names when a request's shared-memory reference is bad.
SHARED_MEMORY_FIELD = "hidden.shared_memory"


def shared_memory_problem(error):
    """For a request that named a region: "forgotten" when the server does
    not know the region (released for idleness, restarted: the client makes
    a new one), "refused" for any other complaint about the reference (the
    client sends bytes instead), None when the error is not about it."""
    field = getattr(error, "field", None) or ""
    if not field.startswith(SHARED_MEMORY_FIELD):
        return None
    gone = isinstance(error, NotFound) and error.reason == "REGION_GONE"
    return "forgotten" if gone else "refused"


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
        options = transfer_options or transfer.TransferOptions()
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
        # The C++ client (native_transport) cannot take the caller's own
        # channel arguments.
        self._custom_channel_args = bool(channel_args)
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
        # logprobs(): each target's connections (the first is the channel
        # above; more are opened for striped calls), its limits once known,
        # and its shared memory.
        self._compute_raw = [[self._raw_compute(c)] for c in self._channels]
        self._extra_channels = [[] for _ in self.targets]
        self._connections_lock = threading.Lock()
        self._limits = [None] * len(self.targets)
        self._limits_asked = [None] * len(self.targets)  # monotonic time
        self._memory = [shm.TargetMemory(t, self.transfer_options) for t in self.targets]
        self._row_copier = shm.RowCopier(self.transfer_options.copy_threads)
        self._shm_stubs = [pb_grpc.SharedMemoryServiceStub(c) for c in self._channels]
        # The C++ client for large calls over gRPC (native_transport), made
        # on first need; why it is not used, once known.
        self._native = None
        self._native_refusal = None
        self._native_lock = threading.Lock()
        # Why the C++ client cannot read rows on a GPU (no CUDA runtime it
        # can load), once known: such calls take the client's own path.
        self._native_device_failure = None
        self._native_device_lock = threading.Lock()  # held by its one call

    def _native_client(self, call, deadline):
        """(the C++ client, on_device) when it should send `call`
        (native_transport): a large call to a single target, within the
        client's own timeout, whose rows go in the messages, or through a
        CUDA region from a tensor the C++ client can read where it lies
        (on_device); else None."""
        options = self.transfer_options
        if options.native_transport == "off":
            return None
        if not call.sliceable or call.hidden_bytes < options.auto_connections_min_bytes:
            return None
        kind = self._memory[0].kind_for(call, time.monotonic())
        # The C++ client's CUDA region holds the whole call: up to the
        # region budget; a larger call goes slice by slice through the
        # client's own regions.
        on_device = (
            kind == "cuda"
            and call.hidden_bytes <= options.shared_memory_bytes
            and self._native_device_failure is None
            and native.takes_device_rows(call)
        )
        if kind is not None and not on_device:
            return None  # the rows go through the client's system region
        with self._native_lock:
            if self._native is None and self._native_refusal is None:
                self._native_refusal = self._native_unsuitable()
                if self._native_refusal is None:
                    try:
                        self._native = native.NativeClient(
                            native.load_library(),
                            self.targets[0],
                            self.timeout,
                            self._max_receive_bytes,
                            options,
                            self._sync_channel_security,
                        )
                    except RuntimeError as why:
                        self._native_refusal = str(why)
                if self._native_refusal is not None:
                    say = log.warning if options.native_transport == "on" else log.info
                    say("large calls go through grpcio: %s", self._native_refusal)
            if self._native is None and options.native_transport == "on":
                raise RuntimeError(f"TransferOptions.native_transport='on': {self._native_refusal}")
            if self._native is None:
                return None
            if on_device and not self._native_device_lock.acquire(blocking=False):
                # The C++ client's calls through its region take turns: a
                # call meanwhile takes the client's own region slots.
                return None
            return self._native, on_device

    def _score_natively(self, chosen, call, timings, deadline):
        """The C++ client's answer to `call` (`chosen`: _native_client's)
        within `deadline`; its failure is raised as the call's (a server
        error never changes the call's path). None only when the C++ client
        cannot read rows on a GPU (no CUDA runtime): the caller then takes
        the Python client's own path, and so do later calls on a GPU. Blocking; the asyncio client runs it in
        an executor, so the region's turn ends when the C++ call does."""
        client, on_device = chosen
        try:
            result, path = client.score(call, timings, on_device, deadline.remaining())
        except native.NativeCallFailed as failed:
            own_failure = (
                failed.details is None
                and on_device
                and failed.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            )
            if not own_failure:
                raise failed.error() from None
            self._native_device_failure = failed.message
            log.info("calls on a GPU take the Python client's path: %s", failed.message)
            return None
        finally:
            if on_device:
                self._native_device_lock.release()
        if on_device and path != "cuda_shm":
            # The server refused the C++ client's CUDA region: later calls
            # take the client's own paths (the refusal logged once, as for
            # its own).
            why = client.shared_memory_refusal()
            if why:
                self._memory[0].refused("cuda", time.monotonic(), RuntimeError(why), log)
        return result

    def _native_unsuitable(self):
        """Why this client's calls cannot go through the C++ client, or None."""
        if len(self.targets) != 1:
            return "several targets (the C++ client takes one)"
        if self._custom_channel_args:
            return "channel_args were given (the C++ client cannot take them)"
        return None

    def _close_native(self):
        with self._native_lock:
            if self._native is not None:
                self._native.close()
                self._native = None

    @staticmethod
    def _raw_compute(channel):
        """ComputeLogProbs taking and giving serialized messages (wire.py
        writes and reads them)."""
        return channel.unary_unary(
            COMPUTE_METHOD, request_serializer=identity, response_deserializer=identity
        )

    def _compute_on(self, index, connection):
        """The raw ComputeLogProbs of connection `connection` to target
        `index`, opening connections up to it on first use."""
        raws = self._compute_raw[index]
        if connection < len(raws):
            return raws[connection]
        with self._connections_lock:
            while len(raws) <= connection:
                channel = self._own_channel(self.targets[index])
                self._extra_channels[index].append(channel)
                raws.append(self._raw_compute(channel))
        return raws[connection]

    def _take_extra_channels(self):
        with self._connections_lock:
            channels = [c for per_target in self._extra_channels for c in per_target]
            self._extra_channels = [[] for _ in self.targets]
            self._compute_raw = [raws[:1] for raws in self._compute_raw]
        return channels

    def _plan_slices(self, call, index):
        """The slices of `call` for target `index`'s limits (known, or the
        server defaults)."""
        options = self.transfer_options
        limits = self._limits[index] or transfer.ServerLimits()
        kind = self._memory[index].kind_for(call, time.monotonic())
        preferred = options.slice_bytes_for(kind, call.hidden_bytes)
        return call.slices(limits, preferred, self._max_receive_bytes)

    def _targets_to_ask_limits(self):
        """Targets whose limits are unknown and were not asked for lately
        (one call asks; calls meanwhile assume the server's defaults, and a
        refusal teaches the real ones)."""
        now = time.monotonic()
        due = []
        with self._connections_lock:
            for index, known in enumerate(self._limits):
                asked = self._limits_asked[index]
                if known is None and (asked is None or now - asked > LIMITS_ASK_AGAIN_S):
                    self._limits_asked[index] = now
                    due.append(index)
        return due

    def _learned_from(self, error, pieces):
        """True when `error` is a server's refusal of a slice over its row or
        message limit, a limit it did not report (an older server): the
        call is cut again to fit it."""
        change = {}
        rows = transfer.rows_limit_in(error)
        if rows is not None and 1 <= rows < max(p.rows for p in pieces):
            change["max_request_rows"] = rows
        if isinstance(error, MessageTooLarge) and error.on_server and error.limit_bytes:
            known = self._limits[0] or transfer.ServerLimits()
            if error.limit_bytes < known.max_message_bytes:
                change["max_message_bytes"] = error.limit_bytes
        if not change:
            return False
        for index, known in enumerate(self._limits):
            self._limits[index] = dataclasses.replace(known or transfer.ServerLimits(), **change)
        return True

    def _after_shared_memory_error(self, index, slot, error):
        """True when the slice should be sent again at once: the server
        forgot the region (released for idleness, restarted: a new one is
        made) or refused shared memory (gRPC bytes from now on)."""
        problem = shared_memory_problem(error)
        if problem is None:
            return False
        memory = self._memory[index]
        if problem == "forgotten":
            # Slices in flight may still write into it: the GC frees it.
            memory.pool_of(slot).forget(slot.region)
        else:
            memory.refused(slot.region.kind, time.monotonic(), error, log)
        return True

    def _staging(self, call, piece, index):
        """What staging the slice's rows in shared memory on target `index`
        takes (shm.Staging), or None: gRPC bytes."""
        memory = self._memory[index]
        kind = memory.kind_for(call, time.monotonic())
        nbytes = piece.rows * call.row_bytes
        if kind is None or not call.sliceable or nbytes == 0:
            return None
        want = nbytes * self.transfer_options.slices_in_flight_per_connection
        return shm.Staging(memory, kind, call, piece, want, self._row_copier)

    def _staging_failed(self, staging, why):
        """No slot (refused, or no memory for a region): gRPC bytes, the
        reason logged once. A passed deadline is raised."""
        if isinstance(why, DeadlineExceeded):
            raise why
        staging.memory.refused(staging.kind, time.monotonic(), why, log)

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
