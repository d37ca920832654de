"""The asyncio detlogp client: the sync Client's methods as coroutines.

Example:
    async with detlogp.aio.AsyncClient("127.0.0.1:50051") as client:
        result = await client.logprobs(hidden, targets)
        more = await client.logprobs(hidden, targets, return_entropy=True, top_k=5)
        async for r in client.stream(items):
            ...
"""

import asyncio
import functools
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
from detlogp.aio_status import ServerStatus
from detlogp.credentials import make_aio_channel
from detlogp.errors import DetlogpError, from_rpc_error
from detlogp.results import logprob_result
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc
from detlogp.weights import DEFAULT_CHUNK_BYTES


class AsyncClient(ClientState):
    """Round-robin over targets, deadlines and retries as in Client, and the
    same model calls (admin_token, two-phase uploads through the same
    detlogp.fleet.Pusher, NOT_FOUND moving
    on for pinned versions), and the same large calls (through the C++
    engine, awaited through its completion callback: no thread per call).
    Create it inside the event loop that uses it; close() frees the engine
    (its regions unregistered; a client not closed does so when the
    process exits)."""

    _make_channel = staticmethod(make_aio_channel)
    # Each call carries the token as metadata: see make_aio_channel.
    _channel_sends_token = False
    # Held by the call asking for limits (made in the client's loop).
    _asking = None

    async def close(self):
        self._close_engine_now()
        if self._fleet_pusher is not None:
            self._fleet_pusher.close()
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def wait_ready(self, timeout=10.0):
        for channel in self._channels:
            await asyncio.wait_for(channel.channel_ready(), timeout)

    @property
    def _admin_call_metadata(self):
        return self._admin_metadata or self._scoring_metadata

    async def _unary(
        self, stubs, method, request, timeout, *, retry_not_found=False, metadata=None
    ):
        plan = CallPlan(self, timeout, retry_not_found)
        while True:
            call = method(stubs[plan.index])
            self.attempts += 1
            try:
                return await call(
                    request,
                    timeout=plan.deadline.remaining(),
                    metadata=metadata or self._scoring_metadata,
                )
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
            pause = plan.after(error)
            if pause is None:
                raise error
            if pause:
                await asyncio.sleep(pause)

    async def info(self, model=None, version=None, *, timeout=None):
        model, timeout = legacy_info_args(model, timeout)
        return await self._unary(
            self._logp,
            lambda s: s.GetModelInfo,
            requests.model_info_request(model, version),
            timeout,
            retry_not_found=bool(version),
        )

    async def health(self, timeout=5.0):
        data = await self._unary(self._health, lambda s: s, b"", timeout)
        return parse_health_response(data)

    async def logprobs(
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
        """Client.logprobs as a coroutine (return_entropy, top_k, timing and
        large calls alike: the engine's answer is awaited on this loop)."""
        fields = logprob_fields(
            request_id, temperature, return_lse, model, version, return_entropy, top_k, timing
        )
        call, timings, started = self._new_call(hidden, targets, fields, timing)
        deadline = Deadline(self.timeout if timeout is None else timeout)
        if self._needs_limits(call):
            await self._learn_limits(deadline)
        if self._route(call) == calls.ENGINE:
            result = self._after_engine(
                await self._engine.score_async(
                    call, asyncio.get_running_loop(), timings, deadline.remaining()
                )
            )
        else:
            sending = calls.TimedRequest(call, timings)
            data = await self._unary(
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

    async def _learn_limits(self, deadline):
        """Client._learn_limits on this loop (calls meanwhile wait)."""
        if self._asking is None:
            self._asking = asyncio.Lock()
        async with self._asking:
            for index in self._targets_to_ask_limits():
                left = deadline.remaining()
                try:
                    info = await self._logp[index].GetModelInfo(
                        requests.model_info_request(),
                        timeout=min(left or 10.0, 10.0),
                        metadata=self._scoring_metadata,
                    )
                except grpc.RpcError:
                    continue
                except asyncio.CancelledError:
                    self._limits_asked[index] = None  # the next call asks
                    raise
                self._limits[index] = calls.ServerLimits.from_model_info(info)

    async def compute(self, request, timeout=None):
        return await self._unary(
            self._logp,
            lambda s: s.ComputeLogProbs,
            request,
            timeout,
            retry_not_found=bool(request.model_version),
        )

    async def stream(self, items, *, timeout=None, model=None, version=None):
        """Async generator over StreamLogProbs; `items` may be a plain or an
        async iterable. One target, no retries."""
        stub = self._logp[self._rr.next()]
        self.attempts += 1
        sent = SentRequests()
        call = stub.StreamLogProbs(
            sent.feed_async(items, model, version),
            timeout=self.timeout if timeout is None else timeout,
            metadata=self._scoring_metadata,
        )
        status = ServerStatus(call)
        try:
            async for response in call:
                yield logprob_result(response, sent.answered())
        except grpc.RpcError as rpc_error:
            if sent.failure is not None:  # an item, not the call, failed
                raise sent.failure from None
            raise from_rpc_error(status.error or rpc_error) from None
        except asyncio.CancelledError:
            if sent.failure is not None:
                raise sent.failure from None
            raise
        finally:
            call.cancel()

    async def project(self, x, *, rows_per_chunk=0, timeout=None, request_id="", streams=0):
        """Client.project as a coroutine (streams alike: several calls are
        read side by side on this loop)."""
        rows = int(np.shape(x)[0]) if np.ndim(x) else 0
        if requests.InterleavedProjection.count_calls(rows, rows_per_chunk, streams) > 1:

            def on_target(index):
                async def call(_, timeout, metadata):
                    return await self._project_interleaved(
                        index, x, rows_per_chunk, streams, request_id, timeout, metadata
                    )

                return call

            return await self._unary(list(range(len(self.targets))), on_target, None, timeout)
        request = requests.project_request(x, rows_per_chunk, request_id)
        rows = int(request.x.shape[0]) if request.x.shape else 0

        def run(stub):
            async def call(req, timeout, metadata):
                assembler = requests.ProjectAssembler(rows)
                async for response in stub.Project(req, timeout=timeout, metadata=metadata):
                    assembler.add(response)
                return assembler.result()

            return call

        return await self._unary(self._proj, run, request, timeout)

    async def _project_interleaved(
        self, index, x, rows_per_chunk, streams, request_id, timeout, metadata
    ):
        """Client._project_interleaved on this loop: the first failure
        cancels every call and is raised."""
        plan = requests.InterleavedProjection(x, rows_per_chunk, streams, request_id)
        extra = [self._own_channel(self.targets[index]) for _ in range(plan.calls - 1)]
        stubs = [self._proj[index]] + [pb_grpc.ProjectionServiceStub(c) for c in extra]
        answers = [
            stub.Project(req, timeout=timeout, metadata=metadata)
            for stub, req in zip(stubs, plan.requests)
        ]

        async def read(call):
            async for response in answers[call]:
                plan.add(call, response)

        tasks = [asyncio.ensure_future(read(call)) for call in range(plan.calls)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t in done and t.exception() is not None]
            if failed:
                raise failed[0].exception()
            return plan.result()
        finally:
            for task, answer in zip(tasks, answers):
                task.cancel()
                answer.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for channel in extra:
                await channel.close()

    # ------------------------------------------------------------ models
    async def list_models(self, timeout=None):
        return await self._unary(
            self._repo,
            lambda s: s.ListModels,
            pb.ListModelsRequest(),
            timeout,
            metadata=self._admin_call_metadata,
        )

    async def load_model(
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
        request = pb.LoadModelRequest(
            model=name,
            path=str(path),
            lm_head_tensor=lm_head_tensor or "",
            bias_tensor=bias_tensor or "",
            vocab_size=int(vocab_size or 0),
            expected_weights_sha256=expected_sha256 or "",
            model_version=int(version or 0),
        )
        outcomes = await self._on_every_target(
            name,
            "LoadModel",
            lambda i, left: self._repo[i].LoadModel(
                request, timeout=left, metadata=self._admin_call_metadata
            ),
            timeout,
        )
        return combine_versions(name, outcomes)

    async def upload_model(
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
        """Client.upload_model as a coroutine: the same push
        (detlogp.fleet.Pusher: one number on every target; with several,
        staged on all, then committed together, or aborted on all when one
        fails; deltas against the version this client pushed last). The
        push runs on a worker thread over sync channels of its own (it
        streams the head and waits for every target); the loop serves other
        calls meanwhile."""
        pusher = self._pusher(metadata=self._admin_call_metadata)
        push = functools.partial(
            pusher.upload_model,
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
        return await asyncio.get_running_loop().run_in_executor(None, push)

    async def unload_model(self, name, version, *, timeout=None):
        request = pb.UnloadModelRequest(model=name, model_version=int(version))
        await self._on_every_target(
            name,
            "UnloadModel",
            lambda i, left: self._repo[i].UnloadModel(
                request, timeout=left, metadata=self._admin_call_metadata
            ),
            timeout,
        )

    async def _on_every_target(self, model, action, call, timeout):
        deadline = Deadline(self._admin_timeout(timeout))

        async def one(index):
            self.attempts += 1
            try:
                return await call(index, deadline.remaining())
            except grpc.RpcError as rpc_error:
                return from_rpc_error(rpc_error)
            except DetlogpError as error:
                return error

        answers = await asyncio.gather(*[one(i) for i in range(len(self.targets))])
        outcomes = dict(zip(self.targets, answers))
        failure = first_failure(model, action, outcomes)
        if failure is not None:
            raise failure
        return outcomes
