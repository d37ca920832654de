"""When and how long to retry: exponential backoff with full jitter.

Retryable: UNAVAILABLE (server down, restarting or draining), with
backoff, and RESOURCE_EXHAUSTED with reason QUEUE_FULL, after the delay the
server names (RetryInfo). Never retried: INVALID_ARGUMENT,
DEADLINE_EXCEEDED, oversize messages, anything else. Retries never outlive
the call's deadline.
"""

import dataclasses
import random

from detlogp.errors import Overloaded, Unavailable


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """max_attempts counts the first try; delays grow initial_backoff_s *
    multiplier**n, capped at max_backoff_s, then a uniform draw in
    [0, delay] ("full jitter") is slept."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def backoff(self, retry_index, rng=random):
        """Seconds to sleep before retry number `retry_index` (0-based)."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retry_index)
        return rng.uniform(0.0, cap)


NO_RETRY = RetryPolicy(max_attempts=1)


def is_retryable(error):
    """True for errors worth another try: Unavailable, and a full queue the
    server says when to come back to (QUEUE_FULL with a RetryInfo)."""
    if isinstance(error, Unavailable):
        return True
    if isinstance(error, Overloaded):
        return error.queue_full and error.retry_delay_s is not None
    return False


# A full queue's retry delay is stretched by a random factor in
# [1, 1 + QUEUE_FULL_JITTER], so that callers refused together come back
# spread out.
QUEUE_FULL_JITTER = 0.5
# The delay when a server names none.
DEFAULT_QUEUE_FULL_DELAY_S = 0.02


def queue_full_delay(error, rng=random):
    """Seconds to wait before sending a request the server refused for a
    full queue (reason QUEUE_FULL with a RetryInfo), or None for any other
    error, or a queue the request can never fit (no RetryInfo)."""
    if getattr(error, "reason", None) != "QUEUE_FULL" or error.retry_delay_s is None:
        return None
    delay = error.retry_delay_s or DEFAULT_QUEUE_FULL_DELAY_S
    return delay * rng.uniform(1.0, 1.0 + QUEUE_FULL_JITTER)
