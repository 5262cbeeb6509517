"""Ingress admission control: a bounded number of requests in flight per replica, and each request's deadline.

Contract:
- ``InflightLimit(limit, retry_after_s).enter()`` admits a request and returns its ``Ticket``, or raises a
  429 ``rate_limit_error`` with ``Retry-After`` when ``limit`` requests are already in flight in this
  replica. So a load far above capacity gets fast answers instead of queueing until it times out.
  ``Ticket.release()`` is idempotent: a streamed response releases from its generator's ``finally`` *and*
  from the response's background task, so the slot is returned however the stream ends (a client that
  leaves before the first byte never starts the generator).
- ``request_deadline(header, default_s)`` is the request's deadline in seconds. An ``X-Request-Timeout``
  header (seconds > 0) lowers the graph's ``ingress.request_timeout_s``, never raises it; a malformed value
  is a 400. Past the deadline the request ends with a 504 (an error event in a stream).
"""

from __future__ import annotations

import math

from omni_serve.api.errors import bad_request, too_many_requests

TIMEOUT_HEADER = "x-request-timeout"


class Ticket:
    def __init__(self, limit: "InflightLimit"):
        self._limit: InflightLimit | None = limit

    def release(self) -> None:
        if self._limit is not None:
            self._limit.inflight -= 1
            self._limit = None


class InflightLimit:
    def __init__(self, limit: int, retry_after_s: float):
        self.limit, self.retry_after_s = limit, retry_after_s
        self.inflight = 0
        self.rejected = 0

    def enter(self) -> Ticket:
        if self.inflight >= self.limit:
            self.rejected += 1
            raise too_many_requests(
                f"The server is at capacity ({self.limit} requests in flight on this replica); retry after "
                f"{max(1, math.ceil(self.retry_after_s))} s.", self.retry_after_s)
        self.inflight += 1
        return Ticket(self)


def request_deadline(header: str | None, default_s: float) -> float:
    if header is None or not header.strip():
        return default_s
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise bad_request(f"X-Request-Timeout must be a positive number of seconds, not {header[:40]!r}.",
                          param="X-Request-Timeout")
    return min(value, default_s)
