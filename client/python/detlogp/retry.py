"""When and how long to retry: exponential backoff with full jitter.

Retryable: UNAVAILABLE (server down, restarting or draining) and
RESOURCE_EXHAUSTED whose message says the server's queue is full. Never
retried: INVALID_ARGUMENT, DEADLINE_EXCEEDED, oversize messages, anything
else. Retries never outlive the call's deadline.
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
    """True for errors worth another try: Unavailable, queue-full Overloaded."""
    if isinstance(error, Unavailable):
        return True
    if isinstance(error, Overloaded):
        return error.queue_full
    return False
