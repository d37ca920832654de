"""Plain result types returned by the clients."""

import dataclasses
from typing import Dict, Optional

import numpy as np

from detlogp.errors import DataLoss


@dataclasses.dataclass
class LogProbResult:
    """One answer: log p(target) per row (float32), logsumexp per row when
    asked for (else None), the key under which equal rows give equal bits,
    and the model and version every row was computed with (pin `version`
    to this `model_version` to get the same bits again).

    entropy: float32 [N], the entropy (nats) of each row's softmax, when
      asked for (return_entropy=True), else None.
    top_ids: int64 [N, k] and top_logprobs: float32 [N, k], each row's k
      most likely tokens and their log-probs in descending order (ties: the
      lower id first), when asked for (top_k=k > 0), else None. A smaller k
      gives a prefix of these rows, with the same bits.
    Like logprobs, their bits depend only on the row (and the key).
    timings: where the call's time went (a calls.CallTimings) when
      logprobs() was called with timing=True, else None.
    path: how the rows travelled: "grpc" (in the messages), "system_shm" or
      "cuda_shm" (a shared-memory region of the engine's).
    path_refused: the region path the server refused ("system_shm",
      "cuda_shm"; the rows then took `path`), else "".
    engine: "native" when the C++ engine sent the call, "python" when it
      was one request sent by grpcio."""

    logprobs: np.ndarray
    lse: Optional[np.ndarray]
    determinism_key: str
    request_id: str = ""
    model: str = ""
    model_version: int = 0
    entropy: Optional[np.ndarray] = None
    top_ids: Optional[np.ndarray] = None
    top_logprobs: Optional[np.ndarray] = None
    timings: Optional[object] = None
    path: str = "grpc"
    engine: str = "python"
    path_refused: str = ""


@dataclasses.dataclass
class ProjectResult:
    """Y = X . W^T + b, [R, 5376] float32, reassembled from the chunks."""

    y: np.ndarray
    determinism_key: str
    chunks: int


def _check_size(field, got, want, why):
    if got != want:
        raise DataLoss(
            f"{field}: the response holds {got} values, expected {want} ({why})", field=field
        )


def check_response(request, response):
    """Raises DataLoss (.field naming it) unless `response` has the sizes
    `request` asks for: N logprobs, N lse / entropy exactly when asked for,
    N * top_k top_ids and top_logprobs."""
    check_sizes(
        response,
        len(request.target_ids),
        request.return_lse,
        request.return_entropy,
        request.top_k,
    )


def check_sizes(response, rows, return_lse, return_entropy, top_k):
    """check_response for an answer to `rows` rows asked with these flags
    (a LogProbResponse or a wire.LogProbAnswer)."""
    per_row = f"{rows} rows"
    _check_size("logprobs", len(response.logprobs), rows, per_row)
    _check_size(
        "lse",
        len(response.lse),
        rows if return_lse else 0,
        per_row if return_lse else "return_lse not set",
    )
    _check_size(
        "entropy",
        len(response.entropy),
        rows if return_entropy else 0,
        per_row if return_entropy else "return_entropy not set",
    )
    k = max(int(top_k), 0)
    why = f"{rows} rows x top_k {k}" if k else "top_k not set"
    _check_size("top_ids", len(response.top_ids), rows * k, why)
    _check_size("top_logprobs", len(response.top_logprobs), rows * k, why)


def logprob_result(response, request=None):
    """Builds a LogProbResult from a LogProbResponse message. With the
    `request` it answers, the sizes are checked first (check_response) and
    entropy / top-k are arrays exactly when the request asked for them;
    without it they are arrays when the response holds values (k inferred
    from the sizes)."""
    if request is not None:
        check_response(request, response)
        want_entropy = bool(request.return_entropy)
        k = max(int(request.top_k), 0)
    else:
        want_entropy = len(response.entropy) > 0
        rows = len(response.logprobs)
        k = len(response.top_ids) // rows if rows and len(response.top_ids) else 0
    lse = np.array(response.lse, dtype=np.float32) if len(response.lse) else None
    entropy = np.array(response.entropy, dtype=np.float32) if want_entropy else None
    top_ids = top_logprobs = None
    if k:
        top_ids = np.array(response.top_ids, dtype=np.int64).reshape(-1, k)
        top_logprobs = np.array(response.top_logprobs, dtype=np.float32).reshape(-1, k)
    return LogProbResult(
        logprobs=np.array(response.logprobs, dtype=np.float32),
        lse=lse,
        determinism_key=response.determinism_key,
        request_id=response.request_id,
        model=response.model,
        model_version=int(response.model_version),
        entropy=entropy,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


@dataclasses.dataclass
class ModelVersionResult:
    """A version published by upload_model or load_model.

    version, weights_sha256, determinism_key: the new version, equal on
    every target of the client (else ReplicaMismatch was raised).
    per_target: {target: ModelVersionStatus} as each server answered.
    """

    model: str
    version: int
    weights_sha256: str
    determinism_key: str
    per_target: Dict[str, object] = dataclasses.field(default_factory=dict)

    @property
    def status(self):
        """The first target's ModelVersionStatus (source, memory_bytes, ...)."""
        return next(iter(self.per_target.values()))
