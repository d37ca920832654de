"""Pushing lm_head versions to a fleet of replicas: one version number for
every replica, and deltas instead of whole heads.

    pusher = detlogp.fleet.Pusher(["10.0.0.1:50051", "10.0.0.2:50051"], admin_token=ADMIN)
    pusher.upload_model("policy", step_1_weights)   # whole head, version N
    pusher.upload_model("policy", step_2_weights)   # delta against N, version N+1
    pusher.last_sent   # {target: ("delta" | "head", bytes)}

Numbering: `version` names the number; given none, the pusher asks every
target (ListModels) and takes one above the highest number any of them has,
so every replica publishes the same number for the same push.

Deltas (UPLOAD_ENCODING_XOR_ZSTD, docs/live_weights.md "Delta uploads"):
`base_version=N` with `base_weights=` the weights of version N sends only
the bits that changed; by default (base_version None, with zstandard
installed) the pusher uses the version it pushed last for that model, whose
weights it kept (a host copy; for CUDA bf16 tensors a copy on their GPU,
where the XOR then runs). `base_version=0` sends the whole head and keeps
no copy. A replica without the base answers FailedPrecondition with reason
BASE_MISSING and gets the whole head.

A "dns:" target (dns:///name:port, a Kubernetes headless Service) stands
for every address its name resolves to, resolved again at each push (every
A and AAAA record, as the C++ client resolves it: detlogp.dns_targets):
each address is a target of its own, numbered, staged, chained and
committed like the others, its certificate checked against the name. A name
that resolves to no address fails the push (Unavailable naming it) before
any server is sent anything. `pusher.servers` lists the last push's
servers; results and last_sent are keyed by them.

Two-phase publish (with more than one target, unless two_phase=False): the
version is first staged on every target (received, digest checked, placed,
warmed up, not servable), then committed on all of them at once; when any
target fails to stage it, it is aborted on all of them and the push raises
that target's error: no target changes what it serves.
"""

import concurrent.futures
import dataclasses
import threading
import time

import grpc
import numpy as np

from detlogp import delta as delta_codec
from detlogp import dns_targets
from detlogp._common import (
    Deadline,
    channel_options,
    combine_versions,
    first_failure,
    normalize_targets,
)
from detlogp.credentials import bearer, make_channel
from detlogp.errors import DetlogpError, from_rpc_error
from detlogp.tensors import is_torch_tensor
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc
from detlogp.weights import DEFAULT_CHUNK_BYTES, LmHead, LmHeadDelta

BASE_MISSING = "BASE_MISSING"


@dataclasses.dataclass
class _Pushed:
    """What the pusher keeps of the version it pushed last, as a base."""

    version: int
    head: LmHead  # a host copy (weight bits, bias)
    device_weight: object = None  # for CUDA inputs: a bf16 copy on the GPU


def _owned_copy(head):
    """`head` with arrays of its own: the caller may overwrite its weights
    in place before the next step."""
    copy = LmHead(
        head.weight.copy(), None if head.bias is None else head.bias.copy(), head.vocab_size
    )
    copy._sha256 = head._sha256
    return copy


class Pusher:
    """Pushes versions of lm_heads to every target at once (no retries:
    these calls change the servers).

    targets: "host:port" strings (or one comma-separated string); a
      "dns:///name:port" target is every address of the name.
    admin_token: sent on every call (the servers' --admin_tokens_file).
    timeout: seconds per push (numbering, then the uploads).
    fanout: "direct" (the pusher uploads to every target) or "chain" (to
      the first only, which forwards each chunk to the next as it arrives;
      targets the chain did not reach get the version directly).
    two_phase: with several targets, stage then commit everywhere (or abort
      everywhere); False: each target publishes as its upload ends.
    root_certificates, client_certificate, client_key: TLS as for Client.
    """

    def __init__(
        self,
        targets,
        admin_token=None,
        *,
        timeout=600.0,
        chunk_bytes=DEFAULT_CHUNK_BYTES,
        fanout="direct",
        two_phase=True,
        root_certificates=None,
        client_certificate=None,
        client_key=None,
        _channels=None,
        _metadata=None,
        _resolver=None,
    ):
        self.targets = normalize_targets(targets)
        self.two_phase = bool(two_phase)
        self.timeout = float(timeout)
        self.chunk_bytes = int(chunk_bytes)
        if fanout not in ("direct", "chain"):
            raise ValueError(f"fanout {fanout!r} is neither 'direct' nor 'chain'")
        self.fanout = fanout
        self._metadata = bearer(admin_token) if admin_token else _metadata
        self._security = dict(
            root_certificates=root_certificates,
            client_certificate=client_certificate,
            client_key=client_key,
        )
        # resolver(host, port) -> ["ip:port", ...] (None: getaddrinfo).
        self._resolver = _resolver
        # Channels of a Client that pushes through this pusher are the
        # Client's to close; a dns: target never uses them (its channel
        # reaches one address per call): the pusher makes one per address.
        self._given_channels = {
            target: channel
            for target, channel in zip(self.targets, _channels or ())
            if dns_targets.parse_dns_target(target) is None
        }
        self._own_channels = {}  # server -> channel made here
        self.servers = []  # the servers of the last push (dns: names expanded)
        self._stubs = []  # of self.servers
        if not any(dns_targets.parse_dns_target(t) for t in self.targets):
            self._resolve()  # no name: the servers are the targets
        self._pushed = {}  # model -> _Pushed
        self.last_sent = {}  # target -> ("delta" | "head", payload bytes)
        # Two-phase: from the first commit sent to the last answered.
        self.last_commit_seconds = None

    def close(self):
        for channel in self._own_channels.values():
            channel.close()
        self._own_channels = {}

    def _resolve(self):
        """Expands the targets into this push's servers (a "dns:" target's
        addresses looked up now) and their stubs."""
        servers = dns_targets.expand_targets(self.targets, self._resolver)
        self.servers = [server.target for server in servers]
        # Pods that left the name: their channels go.
        for gone in set(self._own_channels) - set(self.servers):
            self._own_channels.pop(gone).close()
        self._stubs = [
            pb_grpc.ModelRepositoryServiceStub(self._channel(server)) for server in servers
        ]

    def _channel(self, server):
        """The client's channel for a target it gave, else one of the
        pusher's own (kept for later pushes); with TLS, a name's address
        must present the name's certificate."""
        channel = self._given_channels.get(server.target) or self._own_channels.get(server.target)
        if channel is None:
            options = channel_options(64)
            if server.tls_name and self._security["root_certificates"] is not None:
                options.append(("grpc.ssl_target_name_override", server.tls_name))
            channel = make_channel(server.target, options, **self._security)
            self._own_channels[server.target] = channel
        return channel

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def fleet_version(self, name, *, timeout=None):
        """One above the highest version number of model `name` on any
        target (1 when none has it); raises when a target cannot be asked."""
        self._resolve()
        outcomes = self._highest_versions(name, timeout)
        failure = first_failure(name, "ListModels", outcomes)
        if failure is not None:
            raise failure
        return 1 + max(outcomes.values())

    def _highest_versions(self, name, timeout):
        """{target: highest version number of `name` there, or the error}."""
        deadline = Deadline(timeout or self.timeout)

        def highest(index):
            models = self._stubs[index].ListModels(
                pb.ListModelsRequest(), timeout=deadline.remaining(), metadata=self._metadata
            )
            numbers = [0]
            for info in models.models:
                if info.model == name:
                    numbers.append(info.model_version)
                    numbers.extend(v.version for v in info.versions)
            return max(numbers)

        return self._on_every_target(highest)

    def upload_model(
        self,
        name,
        weight,
        bias=None,
        vocab_size=None,
        *,
        version=None,
        base_version=None,
        base_weights=None,
        fanout=None,
        two_phase=None,
        weights_sha256=None,
        chunk_bytes=None,
        timeout=None,
    ):
        """Publishes the weights as one version of model `name` on every
        target; returns a ModelVersionResult (ReplicaMismatch when targets
        disagree). `weight`, `bias`, `vocab_size` as Client.upload_model.

        version: the number (None: one above the highest any target has).
        base_version: send a delta against this version (0: the whole head;
          None: against the version this pusher pushed last, when it did).
        fanout: "direct" or "chain" (None: the pusher's); see Pusher.
        two_phase: None: the pusher's; see Pusher.
        weights_sha256: the digest the weights must have (the whole head is
          sent, and the server checks its bytes against it; default:
          computed while sending).
        base_weights: the weights of base_version, needed when it is not
          the version this pusher pushed last: an LmHead, a checkpoint path,
          or a (weight, bias) tuple of arrays or tensors.
        """
        deadline = Deadline(timeout or self.timeout)
        chunk_bytes = int(chunk_bytes or self.chunk_bytes)
        self._resolve()
        staged = (self.two_phase if two_phase is None else bool(two_phase)) and len(
            self.servers
        ) > 1
        device_weight = _cuda_bf16(weight)
        head = LmHead.coerce(weight, bias, vocab_size)
        if version is None and len(self.servers) == 1:
            version = 0  # the server's next number (it knows numbers unloaded)
        elif version is None:
            # A target that cannot be asked does not stop the push: its
            # upload fails below, naming it, while the others agree.
            highest = self._highest_versions(name, deadline.remaining()).values()
            version = 1 + max([0] + [v for v in highest if not isinstance(v, BaseException)])
        # A stated digest is checked against the bytes of a whole head.
        lm_head_delta = (
            None
            if weights_sha256 is not None
            else self._delta(name, head, device_weight, base_version, base_weights)
        )

        def push(index, forward_to=()):
            stub = self._stubs[index]
            if lm_head_delta is not None:
                try:
                    answer = stub.UploadModel(
                        _forwarding(
                            head.delta_messages(name, lm_head_delta, chunk_bytes, version),
                            forward_to,
                            staged,
                        ),
                        timeout=deadline.remaining(),
                        metadata=self._metadata,
                    )
                    self.last_sent[self.servers[index]] = ("delta", lm_head_delta.nbytes)
                    return answer
                except grpc.RpcError as rpc_error:
                    error = from_rpc_error(rpc_error)
                    if error.reason != BASE_MISSING:
                        raise error from None
            answer = stub.UploadModel(
                _forwarding(
                    head.messages(name, chunk_bytes, weights_sha256, version),
                    forward_to,
                    staged,
                ),
                timeout=deadline.remaining(),
                metadata=self._metadata,
            )
            self.last_sent[self.servers[index]] = ("head", head.nbytes)
            return answer

        self.last_sent = {}
        outcomes = {}
        pending = range(len(self.servers))
        if (fanout or self.fanout) == "chain" and len(self.servers) > 1:
            # The first target forwards each message down the chain as it
            # arrives; then every target says whether it holds the version,
            # and those the chain did not reach get it directly.
            outcomes.update(self._on_every_target(lambda i: push(i, self.servers[1:]), [0]))
            digest = lm_head_delta.weights_sha256 if lm_head_delta else head.sha256()
            state = pb.ModelVersionStatus.STAGED if staged else pb.ModelVersionStatus.READY
            held = self._on_every_target(
                lambda i: self._held(i, name, version, digest, state, deadline.remaining()),
                range(1, len(self.servers)),
            )
            for target, status in held.items():
                if isinstance(status, pb.ModelVersionStatus):
                    outcomes[target] = status
                    self.last_sent[target] = ("chain", 0)
            pending = [i for i, t in enumerate(self.servers) if t not in outcomes]
        outcomes.update(self._on_every_target(push, pending))
        outcomes = {server: outcomes[server] for server in self.servers}
        if staged:
            outcomes = self._commit_or_abort(name, version, outcomes, deadline)
        failure = first_failure(name, "UploadModel", outcomes)
        if failure is not None:
            raise failure
        result = combine_versions(name, outcomes)
        if base_version == 0:
            # A whole head asked for: no copy is kept (nor the older one).
            self._pushed.pop(name, None)
        else:
            self._pushed[name] = _Pushed(
                result.version,
                _owned_copy(head),
                None if device_weight is None else device_weight.detach().clone(),
            )
        return result

    def _delta(self, name, head, device_weight, base_version, base_weights):
        """The LmHeadDelta to send, or None for the whole head."""
        if base_version == 0:
            return None
        pushed = self._pushed.get(name)
        if base_weights is not None:
            if base_version is None:
                raise ValueError("base_weights needs base_version (the number the servers hold)")
            weight, bias = base_weights if isinstance(base_weights, tuple) else (base_weights, None)
            base = LmHead.coerce(weight, bias, head.vocab_size)
            return head.delta_against(base, base_version)
        if base_version is None and not delta_codec.available():
            return None  # the default delta needs zstandard; the whole head
        if pushed is None or (base_version is not None and base_version != pushed.version):
            if base_version is None:
                return None  # nothing pushed yet: the whole head
            raise ValueError(
                f"base_version {base_version} was not pushed by this pusher; "
                "pass base_weights= (its weights) too"
            )
        if device_weight is not None and pushed.device_weight is not None:
            return _delta_on_device(head, device_weight, pushed)
        return head.delta_against(pushed.head, pushed.version)

    def _commit_or_abort(self, name, version, outcomes, deadline):
        """Two-phase publish's end: when every target staged the version,
        commits it on all of them at once and returns {target: committed
        status or error}; else aborts it on all of them and raises the first
        target's failure (.per_target: every target's outcome)."""
        failed = [t for t, o in outcomes.items() if isinstance(o, BaseException)]
        if failed:

            def abort(index):
                self._stubs[index].AbortVersion(
                    pb.AbortVersionRequest(model=name, model_version=version),
                    timeout=deadline.remaining(),
                    metadata=self._metadata,
                )

            self._on_every_target(abort)
            first = outcomes[failed[0]]
            first.args = (
                f"push aborted on every target ({', '.join(failed)} failed to stage "
                f"version {version}; no target changed what it serves): "
                f"{first.args[0] if first.args else first}",
            )
            first.per_target = {
                t: (o if isinstance(o, BaseException) else _aborted(t, failed))
                for t, o in outcomes.items()
            }
            raise first
        digest = next(iter(outcomes.values())).weights_sha256
        # Every connection is used once before any commit leaves, so the
        # commits go together and the skew window is about one round trip.
        gate = threading.Barrier(len(self.servers))
        times = []  # (sent, answered) per commit

        def commit(index):
            try:
                self._stubs[index].ListModels(
                    pb.ListModelsRequest(), timeout=deadline.remaining(), metadata=self._metadata
                )
            finally:
                gate.wait()
            sent = time.perf_counter()
            try:
                return self._stubs[index].CommitVersion(
                    pb.CommitVersionRequest(
                        model=name, model_version=version, weights_sha256=digest
                    ),
                    timeout=deadline.remaining(),
                    metadata=self._metadata,
                )
            finally:
                times.append((sent, time.perf_counter()))

        committed = self._on_every_target(commit)
        self.last_commit_seconds = max(t[1] for t in times) - min(t[0] for t in times)
        return committed

    def _held(self, index, name, version, digest, state, timeout):
        """The target's status of that version when it holds it with
        `digest` in `state`, else None."""
        models = self._stubs[index].ListModels(
            pb.ListModelsRequest(), timeout=timeout, metadata=self._metadata
        )
        for info in models.models:
            for held in info.versions if info.model == name else ():
                if (held.version, held.weights_sha256, held.state) == (version, digest, state):
                    return held
        return None

    def _on_every_target(self, call, indices=None):
        """call(index) on every target (or those of `indices`) at once:
        {target: answer or error}."""
        indices = list(range(len(self.servers)) if indices is None else indices)
        if not indices:
            return {}

        def one(index):
            try:
                return call(index)
            except grpc.RpcError as rpc_error:
                return from_rpc_error(rpc_error)
            except DetlogpError as error:
                return error

        with concurrent.futures.ThreadPoolExecutor(len(indices)) as pool:
            return dict(zip((self.servers[i] for i in indices), pool.map(one, indices)))

    def _every_target(self, model, action, call):
        """call(index) on every target at once; {target: answer}, or raises
        the first failure with every target's outcome in .per_target."""
        outcomes = self._on_every_target(call)
        failure = first_failure(model, action, outcomes)
        if failure is not None:
            raise failure
        return outcomes


def _aborted(target, failed):
    """The outcome of a target that staged a version the push then aborted."""
    return DetlogpError(
        f"{target}: staged, then aborted ({', '.join(failed)} failed to stage)",
        grpc.StatusCode.ABORTED,
    )


def _forwarding(messages, forward_to, stage=False):
    """The upload's messages, its header naming the chain after the target
    (and asking to stage the version when `stage`)."""
    messages = iter(messages)
    first = next(messages)
    first.header.forward_to.extend(forward_to)
    first.header.stage = stage
    yield first
    yield from messages


def _cuda_bf16(weight):
    """`weight` when it is a bf16 torch tensor on a GPU, else None."""
    if not is_torch_tensor(weight) or not weight.is_cuda:
        return None
    import torch

    return weight if weight.dtype == torch.bfloat16 else None


def _delta_on_device(head, device_weight, pushed):
    """The delta of a CUDA tensor against the GPU copy of the last push: the
    XOR runs on the GPU, only its bits come to the host."""
    weight_xor = delta_codec.xor_bits_on_device(device_weight, pushed.device_weight)
    buffers = [memoryview(np.ascontiguousarray(weight_xor).reshape(-1).view(np.uint8))]
    if head.has_bias:
        bias_xor = np.bitwise_xor(head.bias.view(np.uint32), pushed.head.bias.view(np.uint32))
        buffers.append(memoryview(bias_xor.view(np.uint8)))
    data = delta_codec.compress_xor(buffers)
    return LmHeadDelta(pushed.version, pushed.head.sha256(), head.sha256(), data)
