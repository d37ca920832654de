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

import grpc
import numpy as np

from detlogp import calls, requests
from detlogp._common import (
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
from detlogp.errors import DetlogpError, from_rpc_error
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

    transfer_options: a TransferOptions (which calls go through the C++
      engine, and how it spreads them); shared_memory: "auto" (default),
      "off", "system" or "cuda", overriding transfer_options.shared_memory.
    max_message_mb: the largest answer accepted (the engine cuts calls so
      that theirs fit, and the server's own limit on requests).
    channel_args: more gRPC channel arguments. The engine takes message
      sizes, keepalive, reconnect backoff and grpc.lb_policy_name; any other
      key raises ValueError naming it (unless native_transport is "off").

    With several targets, scoring is round-robin; load_model, upload_model
    and unload_model act on EVERY target (replicas must hold the same
    versions), and a call pinned to a version that one target lacks
    (NOT_FOUND) moves on to the next target. A dns:/// target (a headless
    Service's name) spreads small calls over every address (gRPC's
    round_robin), upload_model reaches every address (resolved at each
    push; detlogp.fleet.Pusher); a large call's slices go through the engine, which makes
    every address the name resolves to a replica (resolved again every 30 s
    and after a replica failed; a dead replica's slices go to another within
    the call's deadline). With several targets, the engine's regions are
    registered with every replica on this host and their slices spread
    over them alike.

    Large calls: a call beyond one request of the server's, or of
    TransferOptions.engine_min_bytes, goes through the C++ engine
    (libdetlogp_client.so, detlogp/engine.py): cut to the server's limits,
    spread over connections, and, to a server on this host (a Unix socket
    or a loopback address), through shared memory the engine owns (a CUDA
    region for a bf16 CUDA tensor, a system region for other rows); the
    answers are put back in order with the bits of one call. A server that
    refuses a region gets the rows in the messages (result.path says which
    way they went). Smaller calls are one request through grpcio. Without
    the engine's library, a call larger than one request raises
    calls.EngineRequired.
    """

    _make_channel = staticmethod(make_channel)

    # ------------------------------------------------------------ lifecycle
    def close(self):
        self._close_engine_now()
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

        Any N works: a call beyond the server's limits goes through the C++
        engine (see the class docstring); the result is in order and has the
        bits of one call. timing: also .timings, where the call's time went
        (a CallTimings; the server's part when it reports it)."""
        fields = logprob_fields(
            request_id, temperature, return_lse, model, version, return_entropy, top_k, timing
        )
        call, timings, started = self._new_call(hidden, targets, fields, timing)
        deadline = Deadline(self.timeout if timeout is None else timeout)
        if self._needs_limits(call):
            self._learn_limits(deadline)
        if self._route(call) == calls.ENGINE:
            result = self._after_engine(self._engine.score(call, timings, deadline.remaining()))
        else:
            sending = calls.TimedRequest(call, timings)
            data = self._unary(
                self._compute_raw,
                lambda raw: raw,
                sending.payload,
                deadline.remaining(),
                retry_not_found=bool(fields.model_version),
            )
            result = sending.result(data)
        if timings is not None:
            timings.total_s = time.perf_counter() - started
        return result

    def _learn_limits(self, deadline):
        """Asks each target whose limits are unknown for them (ModelInfo);
        one that does not answer is asked again LIMITS_ASK_AGAIN_S later,
        the server's defaults assumed meanwhile."""
        with self._asking_lock:
            for index in self._targets_to_ask_limits():
                left = deadline.remaining()
                try:
                    info = self._logp[index].GetModelInfo(
                        requests.model_info_request(), timeout=min(left or 10.0, 10.0)
                    )
                except grpc.RpcError:
                    continue
                self._limits[index] = calls.ServerLimits.from_model_info(info)

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
        # The channels carry the scoring token; admin calls name their own.
        return self._pusher(self._channels, self._admin_metadata).upload_model(
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
