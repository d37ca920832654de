"""Plain result types returned by the clients."""
import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass
class LogProbResult:
    """One answer: log p(target) per row (float32), logsumexp per row when
    asked for (else None), and the key under which equal rows give equal bits."""

    logprobs: np.ndarray
    lse: Optional[np.ndarray]
    determinism_key: str
    request_id: str = ""


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
    )
