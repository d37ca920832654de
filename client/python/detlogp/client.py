"""The synchronous detlogp client.

Example:
    with detlogp.Client(["127.0.0.1:50051", "127.0.0.1:50052"]) as client:
        result = client.logprobs(hidden, targets, return_lse=True, timeout=5)
        more = client.logprobs(hidden, targets, return_entropy=True, top_k=5)
        more.entropy, more.top_ids, more.top_logprobs  # [N], [N, 5], [N, 5]

    # live weights: push a new policy to every target, score pinned to it
    with detlogp.Client(targets, admin_token=ADMIN) as client:
        published = client.upload_model("policy", weight_bf16, bias)
        result = client.logprobs(hidden, ids, model="policy",
                                 version=published.version)
"""

import concurrent.futures
import threading
import time
import weakref

import grpc
import numpy as np

from detlogp import requests, shm, transfer, wire
from detlogp._common import (
    STAGING_FAILURES,
    CallPlan,
    ClientState,
    Deadline,
    SentRequests,
    combine_versions,
    first_failure,
    legacy_info_args,
    logprob_fields,
    parse_health_response,
)
from detlogp.credentials import make_channel
from detlogp.errors import DataLoss, DetlogpError, InvalidArgument, MessageTooLarge, from_rpc_error
from detlogp.results import logprob_result
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc
from detlogp.weights import DEFAULT_CHUNK_BYTES


class Client(ClientState):
    """A client over one or more servers, picked round-robin per call (a
    retry moves on to the next one).

    timeout: default seconds per call, retries included (None: no deadline).
    retry: RetryPolicy for unary calls (UNAVAILABLE, queue-full).
    token: bearer token sent on every call (servers with --auth_tokens_file).
    root_certificates, client_certificate, client_key: PEM bytes for TLS and
      mutual TLS (servers with --tls_cert / --tls_client_ca).
    admin_token: bearer token for ModelRepositoryService calls (list, load,
      upload, unload; servers with --admin_tokens_file), sent on those calls
      only, instead of `token`.
    admin_timeout: default seconds for load/upload/unload (they wait until
      the version is placed and warmed up, or freed).

    transfer_options: a TransferOptions (how logprobs() cuts, stripes and
      places large calls); shared_memory: "auto" (default), "off",
      "system" or "cuda", overriding transfer_options.shared_memory.
    max_message_mb: the largest answer accepted (logprobs() cuts calls so
      that theirs fit, and the server's own limit on requests).

    With several targets, scoring is round-robin; load_model, upload_model
    and unload_model act on EVERY target (replicas must hold the same
    versions), and a call pinned to a version that one target lacks
    (NOT_FOUND) moves on to the next target. A dns:/// target (or an ipv4:
    list) spreads calls, and a large call's slices, over every address
    (gRPC's round_robin).

    Large calls: logprobs() cuts a call into requests within the server's
    row and message limits, sends them side by side over several
    connections (TransferOptions.connections), and puts the answers back in
    order; the bits are those of one call. To a server on this host (a Unix
    socket or a loopback address) the rows go through shared memory the
    client owns (a CUDA region for a bf16 CUDA tensor, a system region for
    other rows); a server that refuses it gets gRPC bytes, and the reason
    is logged once ("detlogp" logger).
    """

    _make_channel = staticmethod(make_channel)

    def __init__(self, targets, **kwargs):
        super().__init__(targets, **kwargs)
        self._slice_pool = None
        self._slice_workers = 0
        self._slice_pool_lock = threading.Lock()
        # Regions are released by close(), or at exit when it was not called.
        self._release_regions = weakref.finalize(
            self, _release_shared_memory, self._memory, self._shm_stubs
        )

    # ------------------------------------------------------------ lifecycle
    def close(self):
        self._release_regions()
        if self._slice_pool is not None:
            self._slice_pool.shutdown(wait=True)
        self._row_copier.close()
        self._close_native()
        for channel in self._take_extra_channels():
            channel.close()
        for channel in self._channels:
            channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout=10.0):
        """Blocks until every target's channel is connected."""
        for channel in self._channels:
            grpc.channel_ready_future(channel).result(timeout=timeout)

    # ------------------------------------------------------------ calls
    def _unary(self, stubs, method, request, timeout, *, retry_not_found=False, metadata=None):
        """Runs stubs[i].method(request) with round-robin, deadline and
        retries (CallPlan)."""
        plan = CallPlan(self, timeout, retry_not_found)
        while True:
            call = method(stubs[plan.index])
            self.attempts += 1
            try:
                if metadata is None:
                    return call(request, timeout=plan.deadline.remaining())
                return call(request, timeout=plan.deadline.remaining(), metadata=metadata)
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
            pause = plan.after(error)
            if pause is None:
                raise error
            if pause:
                time.sleep(pause)

    def info(self, model=None, version=None, *, timeout=None):
        """A ModelInfo message: hidden_size, vocab_size, ..., determinism_key
        of `model` (None: the server's default model) at `version` (None:
        its latest ready one), with .model, .model_version and .versions
        (every version the server holds of that model). A number as the
        first argument is taken as `timeout` (the former signature)."""
        model, timeout = legacy_info_args(model, timeout)
        return self._unary(
            self._logp,
            lambda s: s.GetModelInfo,
            requests.model_info_request(model, version),
            timeout,
            retry_not_found=bool(version),
        )

    def health(self, timeout=5.0):
        """grpc.health.v1 status of the next target: "SERVING", ..."""
        data = self._unary(self._health, lambda s: s, b"", timeout)
        return parse_health_response(data)

    def logprobs(
        self,
        hidden,
        targets,
        *,
        temperature=0.0,
        return_lse=False,
        timeout=None,
        request_id="",
        model=None,
        version=None,
        return_entropy=False,
        top_k=0,
        timing=False,
    ):
        """log p(target) for each row of hidden [N, H]: a LogProbResult.

        model: None for the server's default model. version: None for the
        latest ready version, else that version exactly (NotFound when no
        target holds it). The result names the model and version used
        (.model, .model_version); scoring again with version= that number
        gives the same bits.

        return_entropy: also .entropy, float32 [N] (nats). top_k: also
        .top_ids, int64 [N, top_k], and .top_logprobs, float32 [N, top_k]:
        each row's most likely tokens in descending order, ties to the lower
        id (0: none; a negative top_k raises ValueError, one above the
        server's --max_top_k InvalidArgument with .field "top_k"). Fields
        not asked for are None. The answer's sizes are checked against the
        request (DataLoss naming the field otherwise).

        Any N works: a call beyond the server's limits is cut into requests
        and sent side by side (see the class docstring); the result is in
        order and has the bits of one call. timing: also .timings, where
        the call's time went (a CallTimings; the server's part when it
        reports it)."""
        started = time.perf_counter()
        fields = logprob_fields(
            request_id, temperature, return_lse, model, version, return_entropy, top_k, timing
        )
        call = transfer.LogProbCall(hidden, targets, fields)
        timings = None
        if timing:
            timings = transfer.CallTimings(prepare_s=time.perf_counter() - started)
        result = self._run_call(
            call, Deadline(self.timeout if timeout is None else timeout), timings
        )
        if timings is not None:
            timings.total_s = time.perf_counter() - started
        return result

    # ------------------------------------------------------------ large calls
    def _run_call(self, call, deadline, timings):
        """Sends `call` as slices (side by side when there are several) and
        merges the answers."""
        chosen = self._native_client(call, deadline)
        if chosen is not None:
            result = self._score_natively(chosen, call, timings, deadline)
            if result is not None:
                return result
        if call.rows > 1:
            self._learn_limits(deadline)
        while True:
            pieces = self._plan_slices(call, 0)
            options = self.transfer_options
            connections = min(options.connections_for(call.hidden_bytes), len(pieces))
            if timings is not None:
                timings.connections = connections
            try:
                answers = self._send_slices(call, pieces, deadline, timings, connections)
                break
            except (InvalidArgument, MessageTooLarge) as error:
                if not self._learned_from(error, pieces):
                    raise
        repeat = transfer.versions_to_repeat(answers)
        if repeat and not call.fields.model_version:
            version = answers[0].model_version
            again = self._send_slices(
                call, [pieces[i] for i in repeat], deadline, timings, connections, version
            )
            for i, answer in zip(repeat, again):
                answers[i] = answer
        return transfer.merge_answers(call, pieces, answers, timings)

    def _send_slices(self, call, pieces, deadline, timings, connections, version=None):
        def one(piece):
            return self._send_slice(
                call, piece, deadline, timings, piece.index % connections, version
            )

        in_flight = min(
            len(pieces), connections * self.transfer_options.slices_in_flight_per_connection
        )
        if in_flight <= 1:
            return [one(piece) for piece in pieces]
        pool = self._slice_executor(in_flight)
        futures = [pool.submit(one, piece) for piece in pieces]
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()  # after a failure: the slices not started

    def _slice_executor(self, workers):
        """The client's threads for slices, at least `workers` of them."""
        with self._slice_pool_lock:
            if self._slice_pool is None or self._slice_workers < workers:
                old = self._slice_pool
                self._slice_workers = max(workers, 8)
                self._slice_pool = concurrent.futures.ThreadPoolExecutor(
                    self._slice_workers, thread_name_prefix="detlogp-slice"
                )
                if old is not None:
                    old.shutdown(wait=False)
            return self._slice_pool

    def _learn_limits(self, deadline):
        """Asks each target whose limits are unknown for them (ModelInfo);
        one that does not answer is asked again LIMITS_ASK_AGAIN_S later,
        the server's defaults assumed meanwhile."""
        for index in self._targets_to_ask_limits():
            left = deadline.remaining()
            try:
                info = self._logp[index].GetModelInfo(
                    requests.model_info_request(), timeout=min(left or 10.0, 10.0)
                )
            except grpc.RpcError:
                continue
            self._limits[index] = transfer.ServerLimits.from_model_info(info)

    def _send_slice(self, call, piece, deadline, timings, connection, version=None):
        """One slice with CallPlan's round-robin, retries and deadline; its
        rows in shared memory when the target takes them. A wire.LogProbAnswer."""
        plan = CallPlan(self, deadline.remaining(), bool(call.fields.model_version or version))
        while True:
            index = plan.index
            build_started = time.perf_counter()
            slot = self._stage(call, piece, index, plan.deadline)
            try:
                payload = call.request_bytes(piece, version, ref=shm.region_ref(call, piece, slot))
                sent = time.perf_counter()
                self.attempts += 1
                try:
                    data = self._compute_on(index, connection)(
                        payload, timeout=plan.deadline.remaining()
                    )
                except grpc.RpcError as rpc_error:
                    error = call.slice_error(piece, from_rpc_error(rpc_error))
                else:
                    answered = time.perf_counter()
                    try:
                        answer = wire.decode_logprob_response(data)
                    except ValueError as bad:
                        raise DataLoss(f"LogProbResponse: {bad}") from None
                    answer.path = shm.path_name(slot)
                    if timings is not None:
                        timings.add_slice(
                            sent - build_started,
                            answered - sent,
                            time.perf_counter() - answered,
                            answer.timing,
                            shm.path_name(slot),
                        )
                    return answer
            finally:
                if slot is not None:
                    self._memory[index].pool_of(slot).release(slot)
            if slot is not None and self._after_shared_memory_error(index, slot, error):
                continue
            pause = plan.after(error)
            if pause is None:
                raise error
            if pause:
                time.sleep(pause)

    def _stage(self, call, piece, index, deadline):
        """A slot holding the slice's rows in a region of target `index`, or
        None (gRPC bytes): no region kind applies, or it was refused."""
        staging = self._staging(call, piece, index)
        if staging is None:
            return None
        try:
            slot = self._acquire_slot(index, staging, deadline)
        except STAGING_FAILURES as why:
            return self._staging_failed(staging, why)
        return staging.fill(slot)

    def _acquire_slot(self, index, staging, deadline):
        """A slot in staging.pool, registering a new region when the pool
        asks for one, waiting while every byte is held by slices in flight."""
        pool = staging.pool
        while True:
            got = pool.try_acquire(staging.nbytes, staging.want_bytes)
            if isinstance(got, shm.Slot):
                return got
            if isinstance(got, shm.NeedRegion):
                try:
                    for region in pool.idle_regions_to_drop(got.byte_size):
                        self._unregister(index, region)
                    region = staging.make_region(got.byte_size)
                    try:
                        register = getattr(self._shm_stubs[index], region.register_method)
                        register(region.register_request(pb), timeout=deadline.remaining())
                    except grpc.RpcError as rpc_error:
                        region.close()
                        raise from_rpc_error(rpc_error) from None
                    region.after_register()
                except BaseException:
                    pool.abandon()
                    raise
                pool.add(region)
                continue
            with pool.changed:
                pool.changed.wait(timeout=0.05)
            deadline.remaining()  # DeadlineExceeded once it has passed

    def _unregister(self, index, region):
        _unregister_region(self._shm_stubs[index], region)

    def compute(self, request, timeout=None):
        """ComputeLogProbs on a ready LogProbRequest; the raw response. A
        request pinned to a model_version is retried on the next target when
        one answers NOT_FOUND."""
        return self._unary(
            self._logp,
            lambda s: s.ComputeLogProbs,
            request,
            timeout,
            retry_not_found=bool(request.model_version),
        )

    def stream(self, items, *, timeout=None, model=None, version=None):
        """StreamLogProbs over `items` (LogProbRequest, (hidden, targets), or
        dicts of logprobs() arguments, return_entropy= and top_k= included);
        yields LogProbResults in order, each checked against its request.
        `model` and `version` apply to items that name none. One target, no
        retries: a failure ends the stream with its error."""
        stub = self._logp[self._rr.next()]
        self.attempts += 1
        sent = SentRequests()
        call = stub.StreamLogProbs(
            sent.feed(items, model, version), timeout=self.timeout if timeout is None else timeout
        )
        try:
            for response in call:
                yield logprob_result(response, sent.answered())
        except grpc.RpcError as rpc_error:
            if sent.failure is not None:  # an item, not the call, failed
                raise sent.failure from None
            raise from_rpc_error(rpc_error) from None
        finally:
            call.cancel()  # no-op once finished; frees the call if abandoned

    def project(self, x, *, rows_per_chunk=0, timeout=None, request_id="", streams=0):
        """ProjectionService.Project: Y [R, 5376] fp32 from x [R, 96]
        (a ProjectResult). Retried whole on UNAVAILABLE / queue-full.

        streams > 1 spreads the rows over that many calls side by side, each
        on a connection of its own for the projection, in blocks of
        rows_per_chunk rows (512 when 0): one gRPC stream is read on one
        thread (requests.InterleavedProjection). 0 (the default): 4 calls
        from 8192 rows on, else 1. Y's bits are the same."""
        rows = int(np.shape(x)[0]) if np.ndim(x) else 0
        if requests.InterleavedProjection.count_calls(rows, rows_per_chunk, streams) > 1:

            def on_target(index):
                return lambda _, timeout: self._project_interleaved(
                    index, x, rows_per_chunk, streams, request_id, timeout
                )

            return self._unary(list(range(len(self.targets))), on_target, None, timeout)
        request = requests.project_request(x, rows_per_chunk, request_id)
        rows = int(request.x.shape[0]) if request.x.shape else 0

        def run(stub):
            def call(req, timeout):
                assembler = requests.ProjectAssembler(rows)
                for response in stub.Project(req, timeout=timeout):
                    assembler.add(response)
                return assembler.result()

            return call

        return self._unary(self._proj, run, request, timeout)

    def _project_interleaved(self, index, x, rows_per_chunk, streams, request_id, timeout):
        """One attempt of an interleaved projection on target `index`: the
        first call on the client's channel, the others on connections opened
        for it; the first failure cancels every call and is raised."""
        plan = requests.InterleavedProjection(x, rows_per_chunk, streams, request_id)
        extra = [self._own_channel(self.targets[index]) for _ in range(plan.calls - 1)]
        stubs = [self._proj[index]] + [pb_grpc.ProjectionServiceStub(c) for c in extra]
        answers = [stub.Project(req, timeout=timeout) for stub, req in zip(stubs, plan.requests)]
        failures = []
        lock = threading.Lock()

        def read(call):
            try:
                for response in answers[call]:
                    plan.add(call, response)
            except Exception as error:  # noqa: BLE001 - kept, re-raised below
                with lock:
                    failures.append(error)
                for answer in answers:
                    answer.cancel()

        try:
            with concurrent.futures.ThreadPoolExecutor(plan.calls) as pool:
                list(pool.map(read, range(plan.calls)))
        finally:
            for channel in extra:
                channel.close()
        if failures:
            raise failures[0]
        return plan.result()

    # ------------------------------------------------------------ models
    def list_models(self, timeout=None):
        """ModelRepositoryService.ListModels on the next target: a
        ListModelsResponse with .models (a ModelInfo per model, its
        .versions listing each ModelVersionStatus) and .default_model."""
        return self._unary(
            self._repo,
            lambda s: s.ListModels,
            pb.ListModelsRequest(),
            timeout,
            metadata=self._admin_metadata,
        )

    def load_model(
        self,
        name,
        path,
        lm_head_tensor=None,
        bias_tensor=None,
        vocab_size=None,
        expected_sha256=None,
        *,
        version=None,
        timeout=None,
    ):
        """Loads `path`, a Hugging Face checkpoint directory or .safetensors
        file relative to each server's --model_root (lm_head_tensor None:
        lm_head.weight, else the tied input embedding), as the next version
        of model `name` on every target;
        returns once it is ready and the latest: a ModelVersionResult.
        expected_sha256: the weights' digest must equal it.
        version: the number to publish it as (None: each server's next);
        it must be above every number the model has had there
        (FailedPrecondition otherwise)."""
        request = pb.LoadModelRequest(
            model=name,
            path=str(path),
            lm_head_tensor=lm_head_tensor or "",
            bias_tensor=bias_tensor or "",
            vocab_size=int(vocab_size or 0),
            expected_weights_sha256=expected_sha256 or "",
            model_version=int(version or 0),
        )
        outcomes = self._on_every_target(
            name,
            "LoadModel",
            lambda i, left: self._repo[i].LoadModel(
                request, timeout=left, metadata=self._admin_metadata
            ),
            timeout,
        )
        return combine_versions(name, outcomes)

    def upload_model(
        self,
        name,
        weight,
        bias=None,
        vocab_size=None,
        chunk_bytes=DEFAULT_CHUNK_BYTES,
        *,
        version=None,
        weights_sha256=None,
        base_version=None,
        base_weights=None,
        timeout=None,
    ):
        """Streams an lm_head to every target as the next version of model
        `name`; returns once it is ready and the latest there: a
        ModelVersionResult (.version, .weights_sha256, .determinism_key,
        .per_target). Raises ReplicaMismatch when the targets' keys (or
        version numbers) differ. With several targets the version is staged
        on all of them, then committed on all at once, or aborted on all
        when one fails (detlogp.fleet.Pusher).

        weight: [V_pad, H]: numpy float32/float16 (rounded to bf16 by
          round-to-nearest-even, as the server rounds), ml_dtypes.bfloat16 or
          uint16 bf16 bits, or a torch tensor (CPU or CUDA; bf16 sent as its
          bits); or a detlogp.weights.LmHead prepared once; or the path of
          a Hugging Face checkpoint directory or .safetensors file (its head
          found as the server finds it: LmHead.from_checkpoint).
        bias: [V_pad] float (sent as fp32), or None; with a path, the bias
          tensor's name or None (lm_head.bias when present).
        vocab_size: the real vocabulary (None: every row).
        version: the number to publish it as, above every number the model
          has had on each target (else FailedPrecondition, field
          "header.model_version"); None: the server's next number (one
          target), or one above the highest any target has (several).
        weights_sha256: the digest the weights must have (e.g. recorded by
          the trainer; the whole head is sent); default: computed while
          sending.
        base_version: send only the bits that changed against this version
          (a delta; the XOR runs on the GPU for CUDA bf16 tensors); 0: the
          whole head; None: a delta against the version this client pushed
          last, when it did. A target without the base gets the whole head.
        base_weights: the weights of base_version when this client did not
          push it (an LmHead, a checkpoint path, or (weight, bias)).
        """
        # Keeps what it pushed last (a host copy) as the next delta's base.
        if getattr(self, "_fleet_pusher", None) is None:
            from detlogp.fleet import Pusher

            self._fleet_pusher = Pusher(
                self.targets,
                timeout=self.admin_timeout or 600.0,
                _channels=self._channels,
                _metadata=self._admin_metadata,
            )
        return self._fleet_pusher.upload_model(
            name,
            weight,
            bias,
            vocab_size,
            version=version,
            base_version=base_version,
            base_weights=base_weights,
            weights_sha256=weights_sha256,
            chunk_bytes=chunk_bytes,
            timeout=self._admin_timeout(timeout),
        )

    def unload_model(self, name, version, *, timeout=None):
        """Unloads version `version` of model `name` on every target: new
        requests pinned to it get NotFound at once; returns when every
        request that picked it is answered and it is freed."""
        request = pb.UnloadModelRequest(model=name, model_version=int(version))
        self._on_every_target(
            name,
            "UnloadModel",
            lambda i, left: self._repo[i].UnloadModel(
                request, timeout=left, metadata=self._admin_metadata
            ),
            timeout,
        )

    def _on_every_target(self, model, action, call, timeout):
        """call(i, seconds_left) on every target at once (no retries: these
        calls change the server); {target: answer}, or the first error with
        every target's outcome in its .per_target."""
        deadline = Deadline(self._admin_timeout(timeout))

        def one(index):
            self.attempts += 1
            try:
                return call(index, deadline.remaining())
            except grpc.RpcError as rpc_error:
                return from_rpc_error(rpc_error)
            except DetlogpError as error:
                return error

        if len(self.targets) == 1:
            answers = [one(0)]
        else:
            with concurrent.futures.ThreadPoolExecutor(len(self.targets)) as pool:
                answers = list(pool.map(one, range(len(self.targets))))
        outcomes = dict(zip(self.targets, answers))
        failure = first_failure(model, action, outcomes)
        if failure is not None:
            raise failure
        return outcomes


# Between attempts to unregister a region still held by a request.
UNREGISTER_PAUSE_S = 0.02


def _unregister_region(stub, region, timeout=5.0):
    """Unregisters and frees `region`. The server may still hold the region
    for a request answered a moment ago (FAILED_PRECONDITION): asked again
    for up to `timeout`; any other answer does not matter (the server
    releases unused regions itself after --shared_memory_idle_s)."""
    end = time.monotonic() + timeout
    try:
        unregister = getattr(stub, region.unregister_method)
        while True:
            try:
                unregister(region.unregister_request(pb), timeout=timeout)
                return
            except grpc.RpcError as error:
                in_use = error.code() == grpc.StatusCode.FAILED_PRECONDITION
                if not in_use or time.monotonic() + UNREGISTER_PAUSE_S > end:
                    return
            time.sleep(UNREGISTER_PAUSE_S)
    finally:
        region.close()


def _release_shared_memory(memories, stubs):
    """Every region of every target, unregistered and freed (close(), or at
    exit)."""
    for memory, stub in zip(memories, stubs):
        for pool in memory.pools():
            for region in pool.take_all():
                _unregister_region(stub, region)


def release_shared_memory_at_exit(targets, memories, channel_options, security):
    """_release_shared_memory through sync channels opened for it: for the
    asyncio client, whose own channels need its event loop, gone at exit."""
    for target, memory in zip(targets, memories):
        if not any(pool.held_bytes() for pool in memory.pools()):
            continue
        channel = make_channel(target, channel_options, **security)
        try:
            _release_shared_memory([memory], [pb_grpc.SharedMemoryServiceStub(channel)])
        finally:
            channel.close()
