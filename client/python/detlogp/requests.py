"""Builds request messages from numpy inputs (or torch tensors, see
tensors.py), and reassembles Project chunks."""

import operator

import numpy as np

from detlogp import tensors
from detlogp.errors import DataLoss, DetlogpError
from detlogp.results import ProjectResult
from detlogp.v1 import detlogp_pb2 as pb


def top_k_value(top_k):
    """top_k as the request's int: None -> 0; a negative number raises
    ValueError and a non-integer TypeError, both naming top_k. The upper
    bound (the server's --max_top_k, the vocabulary) is the server's to
    check: InvalidArgument with .field == "top_k"."""
    if top_k is None:
        return 0
    try:
        k = operator.index(top_k)
    except TypeError:
        raise TypeError(f"top_k must be an integer, got {top_k!r}") from None
    if k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no top-k), got {k}")
    return k


def logprob_request(
    hidden,
    targets,
    temperature=0.0,
    return_lse=False,
    request_id="",
    model=None,
    version=None,
    *,
    return_entropy=False,
    top_k=0,
):
    """A LogProbRequest for hidden [N, H] and N target ids, scored with
    `model` (None: the server's default model) at `version` (None or 0: its
    latest ready version). hidden: a numpy array or a torch tensor (CPU or
    CUDA; bf16 sent as its bits, fp16 and fp32 as themselves); targets: ints,
    an integer array or an integer torch tensor. return_entropy: also the
    entropy of each row; top_k: also each row's top_k most likely tokens
    (0: none). Shapes are not checked here: the server names the field that
    is wrong (only a negative top_k is refused here, ValueError)."""
    return pb.LogProbRequest(
        request_id=request_id,
        hidden=tensors.to_tensor(hidden),
        target_ids=tensors.target_ids(targets),
        temperature=float(temperature),
        return_lse=bool(return_lse),
        model=model or "",
        model_version=int(version or 0),
        return_entropy=bool(return_entropy),
        top_k=top_k_value(top_k),
    )


def model_info_request(model=None, version=None):
    return pb.GetModelInfoRequest(model=model or "", model_version=int(version or 0))


def project_request(x, rows_per_chunk=0, request_id=""):
    """A ProjectRequest for x [R, 96] float32."""
    return pb.ProjectRequest(
        request_id=request_id,
        x=tensors.to_tensor(np.asarray(x, dtype=np.float32)),
        rows_per_chunk=int(rows_per_chunk),
    )


class ProjectAssembler:
    """Collects ProjectResponse chunks (any order) into one [R, C] array and
    checks that every row arrived exactly once."""

    def __init__(self, rows):
        self.rows = rows
        self.y = None
        self.filled = np.zeros(rows, dtype=bool)
        self.key = ""
        self.chunks = 0

    def add(self, response):
        chunk = tensors.from_tensor(response.y).astype(np.float32, copy=False)
        if chunk.ndim != 2:
            raise DetlogpError(f"Project chunk has rank {chunk.ndim}, expected 2")
        begin, count = int(response.row_offset), chunk.shape[0]
        if begin < 0 or begin + count > self.rows:
            raise DetlogpError(
                f"Project chunk rows [{begin}, {begin + count}) outside [0, {self.rows})"
            )
        if self.y is None:
            self.y = np.empty((self.rows, chunk.shape[1]), dtype=np.float32)
        if self.filled[begin : begin + count].any():
            raise DetlogpError(f"Project chunk at row {begin} overlaps an earlier one")
        self.y[begin : begin + count] = chunk
        self.filled[begin : begin + count] = True
        self.key = response.determinism_key or self.key
        self.chunks += 1

    def result(self):
        if not self.filled.all():
            missing = int((~self.filled).sum())
            raise DetlogpError(f"Project stream ended with {missing} rows missing")
        y = self.y if self.y is not None else np.empty((0, 0), np.float32)
        return ProjectResult(y=y, determinism_key=self.key, chunks=self.chunks)


# Rows per block of an interleaved projection when rows_per_chunk is 0 (the
# server's default chunk; LogpClient::kInterleavedBlockRows in C++).
INTERLEAVED_BLOCK_ROWS = 512
PROJECTION_OUT = 5376
# streams=0 (the default): AUTO_STREAMS_CALLS calls from AUTO_STREAMS_MIN_ROWS
# rows on, one below (LogpClient::kAutoStreams* in C++): 8192 rows are 176 MB
# of Y, where the extra connections cost far less than they save.
AUTO_STREAMS_MIN_ROWS = 8192
AUTO_STREAMS_CALLS = 4


class InterleavedProjection:
    """One projection spread over several Project calls, as the C++ client's
    ProjectOptions::streams: block b (rows [b * block, (b + 1) * block)) goes
    on call b % calls, each call's x holding its blocks in order, so each of
    its chunks (rows_per_chunk = block) is one whole block, put back at its
    rows. One gRPC stream is read on one thread; several run side by side.
    Each row's projection depends on that row alone: Y's bits are one
    call's. `add` for a call is called from one thread at a time; calls
    write disjoint rows of Y."""

    @staticmethod
    def count_calls(rows, rows_per_chunk, streams):
        """The calls a projection of `rows` rows takes (fewer than `streams`
        when there are fewer blocks); ValueError naming a bad argument."""
        if int(streams) < 0:
            raise ValueError(f"streams must be >= 0 (0: by the projection's size), got {streams}")
        if int(streams) == 0:
            streams = AUTO_STREAMS_CALLS if int(rows) >= AUTO_STREAMS_MIN_ROWS else 1
        if int(rows_per_chunk) < 0:
            raise ValueError(f"rows_per_chunk must be >= 0, got {rows_per_chunk}")
        blocks = -(-int(rows) // (int(rows_per_chunk) or INTERLEAVED_BLOCK_ROWS))
        return max(1, min(int(streams), blocks))

    def __init__(self, x, rows_per_chunk, streams, request_id=""):
        x = np.asarray(x, dtype=np.float32)
        self.rows = int(x.shape[0]) if x.ndim else 0
        self.calls = self.count_calls(self.rows, rows_per_chunk, streams)
        self.block = int(rows_per_chunk) or INTERLEAVED_BLOCK_ROWS
        self.blocks = -(-self.rows // self.block)
        self.requests = []
        for call in range(self.calls):
            starts = range(call * self.block, self.rows, self.calls * self.block)
            rows = np.concatenate([x[s : s + self.block] for s in starts]) if starts else x[:0]
            self.requests.append(
                project_request(rows, self.block, f"{request_id}/{call + 1}of{self.calls}")
            )
        self.y = np.empty((self.rows, PROJECTION_OUT), dtype=np.float32)
        self._answered = [0] * self.calls  # blocks each call has delivered
        self._keys = [None] * self.calls

    def add(self, call, response):
        """Places the next chunk of call `call`; DataLoss naming the field
        when it is not that call's next block."""
        nth = self._answered[call]
        block = call + nth * self.calls
        if block >= self.blocks:
            raise DataLoss(
                f"ProjectResponse.row_offset: call {call} answered more than its {nth} blocks"
            )
        if int(response.row_offset) != nth * self.block:
            raise DataLoss(
                f"ProjectResponse.row_offset: {response.row_offset}, expected "
                f"{nth * self.block} (call {call}'s block {nth})"
            )
        if response.y.dtype != pb.DTYPE_FLOAT32:
            raise DataLoss(f"ProjectResponse.y.dtype: {response.y.dtype}, expected FLOAT32")
        start = block * self.block
        want = min(self.block, self.rows - start)
        chunk = tensors.from_tensor(response.y)
        if chunk.shape != (want, PROJECTION_OUT):
            raise DataLoss(
                f"ProjectResponse.y.shape: {list(chunk.shape)} at row {start}, "
                f"expected [{want}, {PROJECTION_OUT}] (one block)"
            )
        self.y[start : start + want] = chunk
        if self._keys[call] is None:
            self._keys[call] = response.determinism_key
        elif response.determinism_key != self._keys[call]:
            raise DataLoss(
                "ProjectResponse.determinism_key changed within call "
                f"{call}: {self._keys[call]} then {response.determinism_key}"
            )
        self._answered[call] = nth + 1

    def result(self):
        for call in range(self.calls):
            want = len(range(call, self.blocks, self.calls))
            if self._answered[call] != want:
                raise DataLoss(
                    f"Project call {call} ended after {self._answered[call]} of its {want} blocks"
                )
        keys = {k for k in self._keys if k is not None}
        if len(keys) > 1:
            raise DataLoss(f"ProjectResponse.determinism_key: the calls disagree: {sorted(keys)}")
        return ProjectResult(
            y=self.y, determinism_key=keys.pop() if keys else "", chunks=self.blocks
        )
