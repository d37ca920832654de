"""The synchronous detlogp client.

Example:
    with detlogp.Client(["127.0.0.1:50051", "127.0.0.1:50052"]) as client:
        result = client.logprobs(hidden, targets, return_lse=True, timeout=5)
"""
import time

import grpc

from detlogp import requests
from detlogp.credentials import make_channel
from detlogp._common import (ClientState, Deadline, parse_health_response,
                              stream_item_to_request)
from detlogp.errors import from_rpc_error
from detlogp.results import logprob_result
from detlogp.retry import is_retryable
from detlogp.v1 import detlogp_pb2 as pb


class Client(ClientState):
    """A client over one or more servers, picked round-robin per call (a
    retry moves on to the next one).

    timeout: default seconds per call, retries included (None: no deadline).
    retry: RetryPolicy for unary calls (UNAVAILABLE, queue-full).
    token: bearer token sent on every call (servers with --auth_tokens_file).
    root_certificates, client_certificate, client_key: PEM bytes for TLS and
      mutual TLS (servers with --tls_cert / --tls_client_ca).
    """

    _make_channel = staticmethod(make_channel)

    # ------------------------------------------------------------ lifecycle
    def close(self):
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
    def _unary(self, stubs, method, request, timeout):
        """Runs stubs[i].method(request) with round-robin, deadline and retries."""
        deadline = Deadline(self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            stub = stubs[self._rr.next()]
            self.attempts += 1
            try:
                return method(stub)(request, timeout=deadline.remaining())
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
            attempt += 1
            if not is_retryable(error) or attempt >= self.retry.max_attempts:
                raise error
            pause = self.retry.backoff(attempt - 1)
            if not deadline.allows_sleep(pause):
                raise error
            self.retries += 1
            time.sleep(pause)

    def info(self, timeout=None):
        """The server's ModelInfo message (hidden_size, vocab_size, ...,
        determinism_key)."""
        return self._unary(self._logp, lambda s: s.GetModelInfo,
                           pb.GetModelInfoRequest(), timeout)

    def health(self, timeout=5.0):
        """grpc.health.v1 status of the next target: "SERVING", ..."""
        data = self._unary(self._health, lambda s: s, b"", timeout)
        return parse_health_response(data)

    def logprobs(self, hidden, targets, *, temperature=0.0, return_lse=False,
                 timeout=None, request_id=""):
        """log p(target) for each row of hidden [N, H]: a LogProbResult."""
        request = requests.logprob_request(hidden, targets, temperature,
                                           return_lse, request_id)
        return logprob_result(self.compute(request, timeout=timeout))

    def compute(self, request, timeout=None):
        """ComputeLogProbs on a ready LogProbRequest; the raw response."""
        return self._unary(self._logp, lambda s: s.ComputeLogProbs, request,
                           timeout)

    def stream(self, items, *, timeout=None):
        """StreamLogProbs over `items` (LogProbRequest, (hidden, targets), or
        dicts of logprobs() arguments); yields LogProbResults in order.
        One target, no retries: a failure ends the stream with its error."""
        stub = self._logp[self._rr.next()]
        self.attempts += 1
        request_iter = (stream_item_to_request(item, i)
                        for i, item in enumerate(items))
        call = stub.StreamLogProbs(
            request_iter, timeout=self.timeout if timeout is None else timeout)
        try:
            for response in call:
                yield logprob_result(response)
        except grpc.RpcError as rpc_error:
            raise from_rpc_error(rpc_error) from None
        finally:
            call.cancel()  # no-op once finished; frees the call if abandoned

    def project(self, x, *, rows_per_chunk=0, timeout=None, request_id=""):
        """ProjectionService.Project: Y [R, 5376] fp32 from x [R, 96]
        (a ProjectResult). Retried whole on UNAVAILABLE / queue-full."""
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
