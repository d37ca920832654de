"""The asyncio detlogp client: the sync Client's methods as coroutines.

Example:
    async with detlogp.aio.AsyncClient("127.0.0.1:50051") as client:
        result = await client.logprobs(hidden, targets)
        async for r in client.stream(items):
            ...
"""
import asyncio

import grpc

from detlogp import requests
from detlogp.credentials import make_aio_channel
from detlogp._common import (ClientState, Deadline, parse_health_response,
                              stream_item_to_request)
from detlogp.errors import from_rpc_error
from detlogp.results import logprob_result
from detlogp.retry import is_retryable
from detlogp.v1 import detlogp_pb2 as pb


class AsyncClient(ClientState):
    """Round-robin over targets, deadlines and retries as in Client. Create
    it inside the event loop that uses it."""

    _make_channel = staticmethod(make_aio_channel)

    async def close(self):
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def wait_ready(self, timeout=10.0):
        for channel in self._channels:
            await asyncio.wait_for(channel.channel_ready(), timeout)

    async def _unary(self, stubs, method, request, timeout):
        deadline = Deadline(self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            stub = stubs[self._rr.next()]
            self.attempts += 1
            try:
                return await method(stub)(request, timeout=deadline.remaining())
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
            attempt += 1
            if not is_retryable(error) or attempt >= self.retry.max_attempts:
                raise error
            pause = self.retry.backoff(attempt - 1)
            if not deadline.allows_sleep(pause):
                raise error
            self.retries += 1
            await asyncio.sleep(pause)

    async def info(self, timeout=None):
        return await self._unary(self._logp, lambda s: s.GetModelInfo,
                                 pb.GetModelInfoRequest(), timeout)

    async def health(self, timeout=5.0):
        data = await self._unary(self._health, lambda s: s, b"", timeout)
        return parse_health_response(data)

    async def logprobs(self, hidden, targets, *, temperature=0.0,
                       return_lse=False, timeout=None, request_id=""):
        request = requests.logprob_request(hidden, targets, temperature,
                                           return_lse, request_id)
        return logprob_result(await self.compute(request, timeout=timeout))

    async def compute(self, request, timeout=None):
        return await self._unary(self._logp, lambda s: s.ComputeLogProbs,
                                 request, timeout)

    async def stream(self, items, *, timeout=None):
        """Async generator over StreamLogProbs; `items` may be a plain or an
        async iterable. One target, no retries."""
        stub = self._logp[self._rr.next()]
        self.attempts += 1

        async def request_iter():
            index = 0
            if hasattr(items, "__aiter__"):
                async for item in items:
                    yield stream_item_to_request(item, index)
                    index += 1
            else:
                for item in items:
                    yield stream_item_to_request(item, index)
                    index += 1

        call = stub.StreamLogProbs(
            request_iter(), timeout=self.timeout if timeout is None else timeout)
        try:
            async for response in call:
                yield logprob_result(response)
        except grpc.RpcError as rpc_error:
            raise from_rpc_error(rpc_error) from None
        finally:
            call.cancel()

    async def project(self, x, *, rows_per_chunk=0, timeout=None, request_id=""):
        request = requests.project_request(x, rows_per_chunk, request_id)
        rows = int(request.x.shape[0]) if request.x.shape else 0

        def run(stub):
            async def call(req, timeout):
                assembler = requests.ProjectAssembler(rows)
                async for response in stub.Project(req, timeout=timeout):
                    assembler.add(response)
                return assembler.result()
            return call

        return await self._unary(self._proj, run, request, timeout)
