"""Plain result types returned by the clients."""
import dataclasses
from typing import Dict, Optional

import numpy as np


@dataclasses.dataclass
class LogProbResult:
    """One answer: log p(target) per row (float32), logsumexp per row when
    asked for (else None), the key under which equal rows give equal bits,
    and the model and version every row was computed with (pin `version`
    to this `model_version` to get the same bits again)."""

    logprobs: np.ndarray
    lse: Optional[np.ndarray]
    determinism_key: str
    request_id: str = ""
    model: str = ""
    model_version: int = 0


@dataclasses.dataclass
class ProjectResult:
    """Y = X . W^T + b, [R, 5376] float32, reassembled from the chunks."""

    y: np.ndarray
    determinism_key: str
    chunks: int


def logprob_result(response):
    """Builds a LogProbResult from a LogProbResponse message."""
    lse = np.array(response.lse, dtype=np.float32) if len(response.lse) else None
    return LogProbResult(
        logprobs=np.array(response.logprobs, dtype=np.float32),
        lse=lse,
        determinism_key=response.determinism_key,
        request_id=response.request_id,
        model=response.model,
        model_version=int(response.model_version),
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
