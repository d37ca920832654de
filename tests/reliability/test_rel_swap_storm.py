"""8) Swap storm: live weights swapped under load.

One CPU server holds the models "policy" (a new version uploaded every
~0.5 s, --max_versions_per_model=3, kept under a --model_root) and
"reference" (fixed). 200 scoring clients send unary calls and streams, to the
latest version or pinned to one (now and then to one just retired), and
cancel about 40% of them: short deadlines, cancels at a random moment, streams
cut mid-way. Meanwhile an admin thread uploads a new version every ~0.5 s
(digest in the header or as the last message, random chunk sizes, now and then
two at once), unloads an old one every 4th cycle, cancels uploads mid-way,
lets one run into its deadline, and sends whole uploads with a wrong digest.

Holds:
  * the server never crashes and exits 0 on SIGTERM;
  * every answer's bits equal that row's bits under the version the answer
    names, as a fresh server computes them from that version's file (and as
    the storm server gave them when probed right after the upload);
    answers name the version asked for, "latest" never goes back in time,
    and each answer carries its version's determinism key;
  * clients see only CANCELLED, DEADLINE_EXCEEDED, NOT_FOUND (pinned to a
    version that is retired by the end) and RESOURCE_EXHAUSTED "queue full";
    the server's own count of the codes it sent (/metrics) holds no INTERNAL
    or UNKNOWN. (gRPC Python reports a stream that ended while its request
    iterator was still writing as INTERNAL "Internal error from Core", a
    status of its own; those are counted apart and must be covered by the
    call's deadline or by streams the server ended with NOT_FOUND /
    RESOURCE_EXHAUSTED.)
  * uploads end OK, CANCELLED, DEADLINE_EXCEEDED or DATA_LOSS exactly as
    provoked (a cancelled one is CANCELLED on the server too, not
    INVALID_ARGUMENT "ended after N of M bytes"; none fails because scoring
    traffic filled the queue while it warmed up), and unloads OK;
  * versions are numbered 1, 2, 3, ... by successful uploads only; the ready
    set is the model's (latest 3 minus unloaded); --model_root holds exactly
    the ready uploaded versions and no .tmp- leftovers; a restart on that root
    serves the latest version with the same key and bits;
  * the stop line's row counts agree with what clients and admin saw;
  * model memory is released (--max_model_memory_bytes allows 10 versions,
    so leaked reservations would refuse uploads; the gauge equals the ready
    versions' bytes at the end) and RSS after the storm stays within 10% of
    RSS after a warm-up storm.

DETLOGP_SWAP_STORM_S shortens or lengthens the storm (default 30 s).
"""

import asyncio
import hashlib
import os
import random
import threading
import time
from collections import Counter

import grpc
import grpc.aio
import numpy as np
from detlogp import requests
from detlogp.loadgen import RowPool
from detlogp.testing import LocalServer, TestModel
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

H, V, V_PAD = 64, 2000, 2048
CLIENTS = 200
CHANNELS = 10
MAX_VERSIONS = 3
WARM_S = 5.0
STORM_S = float(os.environ.get("DETLOGP_SWAP_STORM_S", "30"))
UPLOAD_EVERY_S = 0.5
TOKEN = "swap-storm-admin-token"
ADMIN = (("authorization", f"Bearer {TOKEN}"),)
VERSION_BYTES = V_PAD * (H * 2 + 4)  # the CPU backend's estimate: bf16 W + fp32 b
WEIGHT_FLAGS = [
    "--lm_head_tensor=lm_head.weight",
    "--bias_tensor=lm_head.bias",
    f"--vocab_size={V}",
]


# ------------------------------------------------------------------ weights


class Version:
    """One set of weights: its file (for the reference server), its bytes as
    an upload sends them and its digest as docs/live_weights.md defines it."""

    def __init__(self, folder, seed):
        self.seed = seed
        self.model = TestModel(folder, hidden=H, vocab=V, padded_vocab=V_PAD, seed=seed)
        self.payload = (
            self.model.weight_bits.astype("<u2").tobytes() + self.model.bias.astype("<f4").tobytes()
        )
        # One 16 MiB digest block per part at this size: the leaves are the
        # weight's and the bias's SHA-256.
        weight = self.model.weight_bits.astype("<u2").tobytes()
        preamble = (
            f"detlogp-lm-head-v2 H={H} V={V} V_pad={V_PAD} bias=1 block={16 << 20}\n"
        ).encode()
        self.sha256 = hashlib.sha256(
            preamble
            + hashlib.sha256(weight).digest()
            + hashlib.sha256(self.model.bias.astype("<f4").tobytes()).digest()
        ).hexdigest()


def upload_messages(version, rng, digest=None, in_header=True, stall=None):
    """The UploadModel stream: header, chunks of random size (some straddle
    the weight/bias boundary), the digest as the last message when not in
    the header. With `stall` = (after_chunks, sent_event, release_event), it
    stops after that many chunks, or before the chunk that would complete
    the weights, and waits (the caller cancels it)."""
    digest = digest or version.sha256
    yield pb.UploadModelRequest(
        header=pb.UploadModelHeader(
            model="policy",
            dtype=pb.DTYPE_BFLOAT16,
            shape=[V_PAD, H],
            vocab_size=V,
            has_bias=True,
            weights_sha256=digest if in_header else "",
        )
    )
    offset, chunks = 0, 0
    while offset < len(version.payload):
        size = rng.choice([1024, 4096, 50_000, 65_536, 100_003])
        # Three large chunks can carry all the weights: a stalled upload
        # must never complete, whatever sizes it drew.
        if stall is not None and (chunks == stall[0] or offset + size >= len(version.payload)):
            stall[1].set()
            stall[2].wait(30)
            return
        yield pb.UploadModelRequest(chunk=version.payload[offset : offset + size])
        offset += size
        chunks += 1
    if not in_header:
        yield pb.UploadModelRequest(weights_sha256=digest)


# ------------------------------------------------------------------ admin


class Shared:
    """What the admin thread publishes to the clients and the checks."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ready = (1,)  # policy versions believed ready, ascending
        self.retired = ()  # recently retired ones (clients pin them too)
        self.retired_all = set()
        self.latest = 1
        self.versions = {}  # number -> Version (1: the start-up file)
        self.upload_status = {}  # number -> ModelVersionStatus
        self.probe = {}  # number -> (logp bits, lse bits) right after upload
        self.counts = Counter()
        self.unexpected = []  # what the admin saw that it did not provoke
        self.ready_mismatch = []  # ListModels vs the model of the ready set

    def publish(self, ready, retired_now):
        with self.lock:
            self.retired_all |= set(retired_now)
            self.retired = tuple((self.retired + tuple(retired_now))[-3:])
            self.ready = tuple(sorted(ready))
            self.latest = max(self.latest, max(ready))


class Admin(threading.Thread):
    def __init__(self, target, shared, pool, folder, stop, seed):
        super().__init__(daemon=True)
        self.shared, self.pool, self.folder, self.stop = shared, pool, folder, stop
        self.rng = random.Random(seed)
        self.channel = grpc.insecure_channel(target)
        self.repo = pb_grpc.ModelRepositoryServiceStub(self.channel)
        self.scoring = pb_grpc.LogProbServiceStub(self.channel)
        self.cycle = 0
        self.error = None

    def new_version(self):
        self.shared.counts["weights_written"] += 1
        return Version(self.folder, seed=1000 + self.shared.counts["weights_written"])

    def upload(self, version, **kwargs):
        """A complete upload; returns (code name, status or None)."""
        try:
            status = self.repo.UploadModel(
                upload_messages(version, self.rng, **kwargs), metadata=ADMIN, timeout=60
            )
            return "OK", status
        except grpc.RpcError as error:
            return error.code().name, error.details()

    def accept(self, version, status):
        s = self.shared
        if status.weights_sha256 != version.sha256:
            s.unexpected.append(
                f"upload v{status.version} reports digest "
                f"{status.weights_sha256}, sent {version.sha256}"
            )
        s.versions[status.version] = version
        s.upload_status[status.version] = status

    def probe(self, number):
        """The pool scored pinned to `number` while it is held (retried on a
        full queue)."""
        request = requests.logprob_request(self.pool.hidden, self.pool.targets, return_lse=True)
        request.model, request.model_version = "policy", number
        for _ in range(200):
            try:
                r = self.scoring.ComputeLogProbs(request, timeout=30)
                break
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.shared.unexpected.append(
                        f"probe of v{number}: {error.code().name} {error.details()}"
                    )
                    return
                time.sleep(0.01)
        else:
            self.shared.unexpected.append(f"probe of v{number}: queue full 200 times")
            return
        self.shared.counts["probe_rows"] += len(self.pool.targets)
        if (
            r.model_version != number
            or r.determinism_key != self.shared.upload_status[number].determinism_key
        ):
            self.shared.unexpected.append(
                f"probe of v{number} answered by v{r.model_version} key {r.determinism_key}"
            )
        self.shared.probe[number] = (
            np.array(r.logprobs, np.float32).view(np.uint32),
            np.array(r.lse, np.float32).view(np.uint32),
        )

    def publish(self, added=(), unloaded=()):
        ready = set(self.shared.ready) | set(added)
        ready -= set(unloaded)
        retired = list(unloaded)
        while len(ready) > MAX_VERSIONS:
            retired.append(min(ready))
            ready.remove(min(ready))
        self.shared.publish(ready, retired)
        listed = self.repo.ListModels(pb.ListModelsRequest(), metadata=ADMIN, timeout=30)
        policy = [m for m in listed.models if m.model == "policy"][0]
        on_server = tuple(
            v.version for v in policy.versions if v.state == pb.ModelVersionStatus.READY
        )
        if on_server != self.shared.ready or policy.model_version != max(ready):
            self.shared.ready_mismatch.append(
                f"cycle {self.cycle}: server ready {on_server} latest "
                f"{policy.model_version}, expected {self.shared.ready}"
            )

    def cancelled_upload(self, by_deadline):
        """Header and a few chunks, then the stream stalls; cancelled by the
        client (or its deadline) while the server waits for the rest."""
        version = self.new_version()
        sent, release = threading.Event(), threading.Event()
        stall = (self.rng.randint(1, 3), sent, release)
        future = self.repo.UploadModel.future(
            upload_messages(version, self.rng, stall=stall),
            metadata=ADMIN,
            timeout=1.0 if by_deadline else 60,
        )
        sent.wait(10)
        time.sleep(0.05)  # the server has read the chunks
        if not by_deadline:
            future.cancel()
        try:
            future.result(timeout=30)
            code = "OK"
        except grpc.FutureCancelledError:
            code = "CANCELLED"
        except grpc.RpcError as error:
            code = error.code().name
        finally:
            release.set()
        want = "DEADLINE_EXCEEDED" if by_deadline else "CANCELLED"
        self.shared.counts[f"upload_{'deadline' if by_deadline else 'cancel'}_{code}"] += 1
        if code != want:
            self.shared.unexpected.append(f"stalled upload: {code}, expected {want}")

    def wrong_digest_upload(self):
        version = self.new_version()
        wrong = Version.__new__(Version)
        wrong.payload = bytearray(version.payload)
        wrong.payload[self.rng.randrange(len(wrong.payload))] ^= 0x10  # one bit
        wrong.payload = bytes(wrong.payload)
        in_header = self.rng.random() < 0.5
        code, detail = self.upload(wrong, digest=version.sha256, in_header=in_header)
        self.shared.counts[f"upload_wrong_digest_{code}"] += 1
        if code != "DATA_LOSS" or "weights_sha256" not in str(detail):
            self.shared.unexpected.append(f"wrong-digest upload: {code} {detail}")

    def good_uploads(self, n):
        versions = [self.new_version() for _ in range(n)]
        results = [None] * n

        def one(i):
            results[i] = self.upload(versions[i], in_header=self.rng.random() < 0.5)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        added = []
        for version, (code, status) in zip(versions, results):
            self.shared.counts[f"upload_{code}"] += 1
            if code != "OK":
                self.shared.unexpected.append(f"upload: {code} {status}")
                continue
            self.accept(version, status)
            added.append(status.version)
        if n > 1:
            self.shared.counts["concurrent_upload_pairs"] += 1
        if added:
            self.publish(added=added)
            for number in added:
                self.probe(number)

    def unload_oldest(self):
        ready = self.shared.ready
        if len(ready) < 2:
            return
        number = ready[0]
        try:
            self.repo.UnloadModel(
                pb.UnloadModelRequest(model="policy", model_version=number),
                metadata=ADMIN,
                timeout=60,
            )
            self.shared.counts["unload_OK"] += 1
            self.publish(unloaded=[number])
        except grpc.RpcError as error:
            self.shared.counts[f"unload_{error.code().name}"] += 1
            self.shared.unexpected.append(
                f"unload v{number}: {error.code().name} {error.details()}"
            )

    def run(self):
        try:
            while not self.stop.is_set():
                began = time.monotonic()
                self.cycle += 1
                c = self.cycle
                if c % 7 == 3:
                    self.cancelled_upload(by_deadline=False)
                if c % 13 == 6:
                    self.cancelled_upload(by_deadline=True)
                if c % 9 == 4:
                    self.wrong_digest_upload()
                self.good_uploads(2 if c % 10 == 8 else 1)
                if c % 4 == 2:
                    self.unload_oldest()
                self.stop.wait(max(0.0, UPLOAD_EVERY_S - (time.monotonic() - began)))
        except Exception as error:  # surfaced by the test
            self.error = error
        finally:
            self.channel.close()


# ------------------------------------------------------------------ clients


class Record:
    """What the clients saw, for the checks after the storm."""

    def __init__(self):
        self.counts = Counter()
        self.answers = []  # (model, version asked, version named, key, rows, logp, lse, latest at send)
        self.not_found = []  # (versions pinned in the call, details)
        self.unexpected = []
        self.client_internal = []  # debug strings of gRPC Python's own INTERNAL


async def storm(target, pool, shared, seconds, seed, record):
    counts = record.counts
    end = time.monotonic() + seconds
    channels = [grpc.aio.insecure_channel(target) for _ in range(CHANNELS)]
    stubs = [pb_grpc.LogProbServiceStub(c) for c in channels]

    def make(rng):
        rows = rng.sample(range(len(pool.targets)), rng.randint(1, 8))
        request = requests.logprob_request(pool.hidden[rows], pool.targets[rows], return_lse=True)
        if rng.random() < 0.15:
            request.model = "reference"
        else:
            request.model = "policy"
            roll = rng.random()
            if roll < 0.35 and shared.ready:
                request.model_version = rng.choice(shared.ready)
            elif roll < 0.42 and shared.retired:
                request.model_version = rng.choice(shared.retired)
        return rows, request, shared.latest

    def take(made, response):
        rows, request, latest_at_send = made
        record.answers.append(
            (
                request.model,
                request.model_version,
                response.model_version,
                response.model,
                response.determinism_key,
                rows,
                np.array(response.logprobs, np.float32).view(np.uint32),
                np.array(response.lse, np.float32).view(np.uint32),
                latest_at_send,
            )
        )
        counts["rows_ok"] += len(rows)

    def failed(kind, code, details, made_list):
        counts[f"{kind}_{code}"] += 1
        pinned = [m[1].model_version for m in made_list if m[1].model_version]
        if code == "NOT_FOUND" and pinned:
            record.not_found.append((pinned, details))
        elif code == "RESOURCE_EXHAUSTED" and "queue full" in details:
            if kind == "unary":
                counts["rows_queue_full"] += len(made_list[0][0])
        elif code not in (
            "CANCELLED",
            "DEADLINE_EXCEEDED",
            "INTERNAL_lost_after_deadline",
            "INTERNAL_lost_status",
        ):
            record.unexpected.append(f"{kind} {code}: {details}")

    async def client(index):
        rng = random.Random(seed * 10_000 + index)
        stub = stubs[index % len(stubs)]
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(0.02, 0.12))
            mode = rng.random()
            timeout = rng.uniform(0.001, 0.010) if mode < 0.15 else 30
            cancel_after = rng.uniform(0, 0.010) if 0.15 <= mode < 0.40 else None
            counts["calls"] += 1
            counts[
                "calls_short_deadline"
                if mode < 0.15
                else "calls_cancelled_by_client"
                if cancel_after is not None
                else "calls_left_alone"
            ] += 1
            if rng.random() < 0.5:
                counts["calls_unary"] += 1
                made = make(rng)
                counts["rows_sent"] += len(made[0])
                call = stub.ComputeLogProbs(made[1], timeout=timeout)
                if cancel_after is not None:
                    asyncio.get_running_loop().call_later(cancel_after, call.cancel)
                try:
                    take(made, await call)
                    counts["unary_OK"] += 1
                except asyncio.CancelledError:
                    counts["unary_cancelled_here"] += 1
                    counts["rows_not_ok"] += len(made[0])
                except grpc.RpcError as error:
                    failed("unary", error.code().name, error.details() or "", [made])
                    counts["rows_not_ok"] += len(made[0])
            else:
                counts["calls_stream"] += 1
                batch = [make(rng) for _ in range(rng.randint(1, 4))]
                answered, written = 0, 0

                async def writes():
                    nonlocal written
                    for made in batch:
                        written += 1
                        counts["rows_sent"] += len(made[0])
                        yield made[1]
                        await asyncio.sleep(0)  # answers may overtake the writes

                started = time.monotonic()
                call = stub.StreamLogProbs(writes(), timeout=timeout)
                if cancel_after is not None:
                    asyncio.get_running_loop().call_later(cancel_after, call.cancel)
                try:
                    async for response in call:
                        take(batch[answered], response)
                        answered += 1
                    counts["stream_OK" if answered == len(batch) else "stream_SHORT"] += 1
                    if answered != len(batch):
                        record.unexpected.append(
                            f"stream ended OK after {answered} of {len(batch)} answers"
                        )
                except asyncio.CancelledError:
                    counts["stream_cancelled_here"] += 1
                except grpc.RpcError as error:
                    code = error.code().name
                    if code == "INTERNAL" and error.details() == "Internal error from Core":
                        # gRPC Python's own status, not the server's: a write
                        # of the request iterator failed because the call had
                        # ended (its deadline, or the server finishing the
                        # stream with NOT_FOUND / RESOURCE_EXHAUSTED), and the
                        # real status is lost. Checked against the server's
                        # own counts of the codes it sent, below.
                        code = (
                            "INTERNAL_lost_after_deadline"
                            if time.monotonic() - started >= timeout
                            else "INTERNAL_lost_status"
                        )
                        if len(record.client_internal) < 2:
                            record.client_internal.append(error.debug_error_string())
                    failed(
                        "stream",
                        code,
                        (error.details() or "")
                        + f" [{'deadline ' if mode < 0.15 else ''}{'cancel ' if cancel_after is not None else ''}"
                        f"after {1e3 * (time.monotonic() - started):.1f} ms, answered {answered}, "
                        f"written {written}/{len(batch)}, pinned {[m[1].model_version for m in batch]}]",
                        batch,
                    )
                counts["rows_not_ok"] += sum(len(m[0]) for m in batch[answered:written])

    await asyncio.gather(*[client(i) for i in range(CLIENTS)])
    for channel in channels:
        await channel.close()


def run_phase(server, pool, shared, folder, seconds, seed, record):
    stop = threading.Event()
    admin = Admin(server.target, shared, pool, folder, stop, seed)
    admin.start()
    try:
        asyncio.run(storm(server.target, pool, shared, seconds, seed, record))
    finally:
        stop.set()
        admin.join(120)
    assert not admin.is_alive(), "the admin thread hung"
    if admin.error is not None:
        raise admin.error
    return admin.cycle


def settle(server, timeout=30.0):
    """Waits until no policy version is UNLOADING; returns ListModels."""
    channel = grpc.insecure_channel(server.target)
    repo = pb_grpc.ModelRepositoryServiceStub(channel)
    end = time.monotonic() + timeout
    while True:
        listed = repo.ListModels(pb.ListModelsRequest(), metadata=ADMIN, timeout=30)
        unloading = [
            v.version
            for m in listed.models
            for v in m.versions
            if v.state != pb.ModelVersionStatus.READY
        ]
        if not unloading or time.monotonic() > end:
            channel.close()
            return listed, unloading
        time.sleep(0.05)


def score_pool(target, pool, model, version=0):
    with grpc.insecure_channel(target) as channel:
        request = requests.logprob_request(pool.hidden, pool.targets, return_lse=True)
        request.model, request.model_version = model, version
        r = pb_grpc.LogProbServiceStub(channel).ComputeLogProbs(request, timeout=60)
    return (
        np.array(r.logprobs, np.float32).view(np.uint32),
        np.array(r.lse, np.float32).view(np.uint32),
        r,
    )


# ------------------------------------------------------------------ the test


def test_swap_storm_keeps_every_answer_on_its_version(server_binary, tmp_path, report):
    began = time.monotonic()
    folder = tmp_path / "weights"
    root = tmp_path / "model_root"
    folder.mkdir()
    root.mkdir()
    tokens = tmp_path / "admin_tokens"
    tokens.write_text(f"# swap storm\n{TOKEN}\n")
    shared = Shared()
    shared.versions[1] = Version(folder, seed=1000)
    reference = Version(folder, seed=999)
    base_flags = WEIGHT_FLAGS + [
        f"--model=policy={shared.versions[1].model.path}",
        f"--model=reference={reference.model.path}",
        f"--model_root={root}",
        f"--max_versions_per_model={MAX_VERSIONS}",
        f"--admin_tokens_file={tokens}",
        "--cpu_threads=1",
    ]
    flags = base_flags + [
        f"--max_model_memory_bytes={10 * VERSION_BYTES}",
        "--max_queue_delay_us=2000",
        "--max_queue_rows=256",
    ]
    pool = RowPool.random(H, V, rows=64, seed=11)
    record = Record()
    server = LocalServer(server_binary, flags, metrics=True).start()
    try:
        cycles = run_phase(server, pool, shared, folder, WARM_S, 1, record)
        time.sleep(1.0)
        rss_warm = server.rss_kib()
        versions_warm = shared.latest
        cycles += run_phase(server, pool, shared, folder, STORM_S, 2, record)
        alive = server.running()
        listed, unloading = settle(server)
        time.sleep(1.0)
        rss_after = server.rss_kib()
        metrics = server.metrics() or {}
        exit_code = server.terminate()
    finally:
        if server.running():
            server.kill()
    stop = server.stop_counts()
    log = server.log()
    storm_s = time.monotonic() - began

    # ---- reference bits: a fresh server loads every version from its file.
    numbers = sorted(shared.versions)
    ref_flags = (
        WEIGHT_FLAGS
        + ["--cpu_threads=1"]
        + [f"--model=p{n}={shared.versions[n].model.path}" for n in numbers]
        + [f"--model=reference={reference.model.path}"]
    )
    expected = {}
    keys = {}
    with LocalServer(server_binary, ref_flags) as fresh:
        for n in numbers:
            logp, lse, r = score_pool(fresh.target, pool, f"p{n}")
            expected[("policy", n)] = (logp, lse)
            keys[("policy", n)] = r.determinism_key
        logp, lse, r = score_pool(fresh.target, pool, "reference")
        expected[("reference", 1)] = (logp, lse)
        keys[("reference", 1)] = r.determinism_key
        assert fresh.terminate() == 0

    # ---- a restart on the same --model_root serves the latest kept version.
    latest = max(shared.ready)
    stored = sorted(int(p.name) for p in (root / "policy").iterdir() if p.name.isdigit())
    leftovers = [p.name for p in (root / "policy").iterdir() if p.name.startswith(".tmp-")]
    with LocalServer(server_binary, base_flags) as again:
        logp, lse, r = score_pool(again.target, pool, "policy")
        restart_ok = (
            r.model_version == latest
            and r.determinism_key == keys[("policy", latest)]
            and logp.tobytes() == expected[("policy", latest)][0].tobytes()
            and lse.tobytes() == expected[("policy", latest)][1].tobytes()
        )
        restart_exit = again.terminate()

    # ---- every answer against the bits of the version it names.
    c = record.counts
    mismatched, wrong_version, stale, wrong_key = [], [], [], []
    per_version = Counter()
    for model, asked, named, named_model, key, rows, logp, lse, latest_at_send in record.answers:
        per_version[(named_model, named)] += 1
        want = expected.get((model, named))
        if named_model != model or (asked and named != asked) or want is None:
            wrong_version.append((model, asked, named_model, named))
            continue
        if model == "policy" and not asked and named < latest_at_send:
            stale.append((named, latest_at_send))
        if key != keys[(model, named)]:
            wrong_key.append((model, named, key))
        if logp.tobytes() != want[0][rows].tobytes() or lse.tobytes() != want[1][rows].tobytes():
            mismatched.append((model, named, rows))
    probe_bad = [
        n
        for n, (logp, lse) in shared.probe.items()
        if logp.tobytes() != expected[("policy", n)][0].tobytes()
        or lse.tobytes() != expected[("policy", n)][1].tobytes()
    ]
    upload_key_bad = [
        n for n, st in shared.upload_status.items() if st.determinism_key != keys[("policy", n)]
    ]
    bad_not_found = [
        (pinned, d)
        for pinned, d in record.not_found
        if not set(pinned) & shared.retired_all
        or ("model_version" not in d and "Internal error from Core" not in d)
    ]
    uploaded = sorted(shared.upload_status)

    # ---- what the server says it answered, by method and code.
    codes = Counter()
    for name, value in metrics.items():
        if name.startswith("detlogp_requests_total{"):
            method = name.split('method="')[1].split('"')[0]
            codes[(method, name.split('code="')[1].split('"')[0])] += int(value)
    server_bad = {
        k: v
        for k, v in codes.items()
        if k[1]
        not in (
            "OK",
            "CANCELLED",
            "DEADLINE_EXCEEDED",
            "NOT_FOUND",
            "RESOURCE_EXHAUSTED",
            "DATA_LOSS",
        )
        or (k[1] == "DATA_LOSS" and k[0] != "UploadModel")
    }
    a = shared.counts
    uploads_cancelled = a["upload_cancel_CANCELLED"] + a["upload_deadline_DEADLINE_EXCEEDED"]
    upload_codes = {code: n for (method, code), n in codes.items() if method == "UploadModel"}
    upload_codes_want = {"OK": a["upload_OK"], "DATA_LOSS": a["upload_wrong_digest_DATA_LOSS"]}
    upload_cancelled_seen = upload_codes.pop("CANCELLED", 0)
    # Streams the server ended with NOT_FOUND or RESOURCE_EXHAUSTED: the client
    # saw those codes, or lost them to gRPC Python's INTERNAL.
    stream_ended_by_server = (
        codes[("StreamLogProbs", "NOT_FOUND")] + codes[("StreamLogProbs", "RESOURCE_EXHAUSTED")]
    )
    stream_ended_seen = (
        c["stream_NOT_FOUND"] + c["stream_RESOURCE_EXHAUSTED"] + c["stream_INTERNAL_lost_status"]
    )

    # ---- row accounting: the stop line against what clients and admin saw.
    warmup_rows = 2 * (2 + len(uploaded))  # policy v1 + reference + every upload
    delivered = c["rows_ok"] + a["probe_rows"] + warmup_rows
    model_rows = sum(v for k, v in metrics.items() if k.startswith("detlogp_model_rows_total"))
    ready_bytes = sum(v.memory_bytes for m in listed.models for v in m.versions)
    policy = [m for m in listed.models if m.model == "policy"][0]
    cancelled_here = c["unary_cancelled_here"] + c["stream_cancelled_here"]
    deadlines = (
        c["unary_DEADLINE_EXCEEDED"]
        + c["stream_DEADLINE_EXCEEDED"]
        + c["stream_INTERNAL_lost_after_deadline"]
    )

    report(
        f"tried: {CLIENTS} clients for {WARM_S:.0f} s (warm-up) + {STORM_S:.0f} s, "
        f"{c['calls']} calls ({c['calls_unary']} unary, {c['calls_stream']} streams of 1-4 "
        f"requests; 15% to 'reference', 35% pinned to a ready version, 7% to a retired one); "
        f"{c['calls_short_deadline']} with 1-10 ms deadlines, {c['calls_cancelled_by_client']} "
        f"cancelled at a random moment in [0, 10 ms], the rest left alone"
    )
    report(
        f"tried: admin {cycles} cycles of ~{UPLOAD_EVERY_S} s: uploads "
        f"{ {k[7:]: v for k, v in sorted(a.items()) if k.startswith('upload_')} } "
        f"({a['concurrent_upload_pairs']} concurrent pairs), {a['unload_OK']} unloads"
    )
    report(
        f"client outcomes: { {k: v for k, v in sorted(c.items()) if not k.startswith(('rows', 'calls'))} }"
    )
    report(f"server codes: { {f'{m}/{code}': n for (m, code), n in sorted(codes.items())} }")
    report(
        f"streams ended by the server with NOT_FOUND / RESOURCE_EXHAUSTED "
        f"{stream_ended_by_server} >= seen by clients as such {c['stream_NOT_FOUND']} + "
        f"{c['stream_RESOURCE_EXHAUSTED']} or as gRPC Python's INTERNAL "
        f"{c['stream_INTERNAL_lost_status']} ('Internal error from Core': "
        f"{(record.client_internal or [''])[0][:120]})"
    )
    report(
        f"versions: uploaded 2..{max(uploaded)}, {len(per_version)} (model, version) pairs "
        f"answered; ready at the end {[v.version for v in policy.versions]}, on disk "
        f"{stored}, .tmp leftovers {leftovers}"
    )
    report(
        f"held: {sum(len(x[5]) for x in record.answers)} rows in {len(record.answers)} answers "
        f"checked against a fresh server's bits for the version named: mismatches "
        f"{len(mismatched)}, wrong version {len(wrong_version)}, stale 'latest' {len(stale)}, "
        f"wrong key {len(wrong_key)}; post-upload probes {len(shared.probe)} (bad "
        f"{len(probe_bad)}); NOT_FOUND on pinned versions {len(record.not_found)} (not "
        f"retired {len(bad_not_found)}); unexpected client errors {len(record.unexpected)}, "
        f"admin {len(shared.unexpected)}, ready-set mismatches {len(shared.ready_mismatch)}"
    )
    report(
        f"held: server alive {alive}, exit {exit_code}; stop line {stop}; delivered rows "
        f"{c['rows_ok']} + probes {a['probe_rows']} + warm-up {warmup_rows} = {delivered}; "
        f"sent and not answered {c['rows_not_ok']}; model rows metric {model_rows:.0f}"
    )
    report(
        f"held: model memory gauge {metrics.get('detlogp_model_memory_bytes'):.0f} = ready "
        f"bytes {ready_bytes}; RSS after warm-up (v{versions_warm}) {rss_warm} KiB, after "
        f"the storm (v{shared.latest}) {rss_after} KiB "
        f"({100.0 * (rss_after - rss_warm) / rss_warm:+.1f}%; {len(uploaded)} uploads of "
        f"{VERSION_BYTES >> 10} KiB); restart on the root serves v{latest} with the same key "
        f"and bits: {restart_ok} (exit {restart_exit}); whole test {storm_s:.0f} s"
    )
    for line in (
        record.unexpected[:5]
        + shared.unexpected[:5]
        + shared.ready_mismatch[:5]
        + [f"NOT_FOUND {x}" for x in bad_not_found[:5]]
        + [f"mismatch {x}" for x in mismatched[:5]]
        + [f"wrong version {x}" for x in wrong_version[:5]]
        + [f"stale {x}" for x in stale[:5]]
        + [f"server code {server_bad}"] * bool(server_bad)
    ):
        report(f"unexpected: {line}")

    assert alive and exit_code == 0, log[-3000:]
    # The storm was one: enough calls, cancels, deadlines, uploads and failures of each kind.
    scale = (WARM_S + STORM_S) / 35.0
    assert c["calls"] > 8000 * scale and len(record.answers) > 4000 * scale, dict(c)
    assert cancelled_here > 1000 * scale and deadlines > 300 * scale
    assert len(record.not_found) > 100 * scale
    assert uploaded == list(range(2, 2 + len(uploaded))) and len(uploaded) >= STORM_S
    assert a["upload_cancel_CANCELLED"] >= 2 and a["upload_deadline_DEADLINE_EXCEEDED"] >= 1
    assert a["upload_wrong_digest_DATA_LOSS"] >= 2 and a["unload_OK"] >= 5
    assert not shared.unexpected and not shared.ready_mismatch
    # Errors: only the allowed ones, on both sides.
    assert not record.unexpected and not bad_not_found
    assert not server_bad, server_bad
    # A cancelled upload is CANCELLED on the server too, never INVALID_ARGUMENT
    # "the upload ended after N of M bytes" (a race that would show on about
    # half of them); one whose header never reached the server is not counted.
    assert upload_codes == upload_codes_want, (upload_codes, upload_codes_want)
    assert 1 <= upload_cancelled_seen <= uploads_cancelled
    assert stream_ended_by_server >= stream_ended_seen
    # Answers: on the version they name, with its key and bits.
    assert not wrong_version and not stale and not wrong_key and not mismatched
    assert not probe_bad and not upload_key_bad
    # The model and its store after the storm.
    assert not unloading, f"versions still unloading after the storm: {unloading}"
    assert [v.version for v in policy.versions] == list(shared.ready)
    assert stored == [n for n in shared.ready if n != 1] and not leftovers
    assert restart_ok and restart_exit == 0
    # Row accounting: every delivered row computed once, no row with two fates.
    # (Rejected rows are left out of the sum: a warm-up offered to a full
    # queue is refused and offered again.)
    assert stop is not None
    assert stop["computed"] >= delivered
    assert stop["computed"] - delivered + stop["expired"] + stop["cancelled"] <= c["rows_not_ok"]
    assert stop["rejected"] >= c["rows_queue_full"]
    assert c["rows_ok"] + a["probe_rows"] <= model_rows <= stop["computed"] - warmup_rows
    # Memory: reservations released, RSS flat.
    assert metrics.get("detlogp_model_memory_bytes") == ready_bytes
    assert rss_after - rss_warm <= 0.10 * rss_warm


def test_uploads_warm_up_through_a_full_queue(server_binary, tmp_path, report):
    """Scoring traffic keeps a 64-row queue full while 20 versions are
    uploaded: each version's 2-row warm-up waits for room instead of refusing
    the whole upload with RESOURCE_EXHAUSTED."""
    first = Version(tmp_path, seed=1)
    flags = WEIGHT_FLAGS + [
        f"--model=policy={first.model.path}",
        "--cpu_threads=1",
        "--max_queue_rows=64",
        "--max_batch_rows=32",
        "--max_queue_delay_us=20000",
    ]
    outcomes, flood = Counter(), Counter()
    with LocalServer(server_binary, flags) as server:
        stop = threading.Event()

        def flooder(seed):
            with grpc.insecure_channel(server.target) as channel:
                stub = pb_grpc.LogProbServiceStub(channel)
                hidden = np.random.default_rng(seed).standard_normal((8, H)).astype(np.float32)
                request = requests.logprob_request(hidden, np.arange(8))
                pending = []
                while not stop.is_set():
                    pending.append(stub.ComputeLogProbs.future(request, timeout=30))
                    if len(pending) >= 64:
                        for future in pending[:32]:
                            try:
                                future.result()
                                flood["OK"] += 1
                            except grpc.RpcError as error:
                                flood[error.code().name] += 1
                        del pending[:32]
                for future in pending:
                    future.cancel()

        threads = [threading.Thread(target=flooder, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            rng = random.Random(3)
            with grpc.insecure_channel(server.target) as channel:
                repo = pb_grpc.ModelRepositoryServiceStub(channel)
                for i in range(20):
                    try:
                        repo.UploadModel(
                            upload_messages(Version(tmp_path, seed=10 + i), rng), timeout=60
                        )
                        outcomes["OK"] += 1
                    except grpc.RpcError as error:
                        outcomes[f"{error.code().name}: {error.details()[:80]}"] += 1
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        exit_code = server.terminate()
        stop_line = server.stop_counts()
    report(
        f"tried: 20 uploads while 3 flooders keep ~192 calls of 8 rows in flight "
        f"against --max_queue_rows=64; flood outcomes {dict(flood)}"
    )
    report(f"held: uploads {dict(outcomes)}; exit {exit_code}; stop line {stop_line}")
    assert flood["RESOURCE_EXHAUSTED"] > 100  # the queue was full
    assert outcomes == {"OK": 20}
    assert exit_code == 0
