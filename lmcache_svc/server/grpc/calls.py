"""How every gRPC handler of the server ends a call: counted, timed, and its errors turned
into a status code (``server/status.py``) plus the error kind in trailing metadata
(``wire.ERROR_KIND_KEY``)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import grpc

from lmcache_svc.errors import LMCacheSvcError
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.status import INTERNAL_KIND, grpc_code
from lmcache_svc.wire import ERROR_KIND_KEY

log = logging.getLogger(__name__)
T = TypeVar("T")


async def abort_call(
    context: grpc.aio.ServicerContext, error: Exception, metrics: Metrics, method: str
) -> None:
    """End the call with the status that reports ``error`` (counted in the errors metric).

    A project error sends its message and kind. Anything else is a bug: ``INTERNAL`` with a
    generic message, the traceback only in the server's log (never ``UNKNOWN`` with the
    exception's text, which may show internals to the client).
    """
    if isinstance(error, LMCacheSvcError):
        kind, message = error.kind, str(error)
    else:
        log.error("gRPC %s failed unexpectedly", method, exc_info=error)
        kind, message = INTERNAL_KIND, f"internal error in {method}; the server log has details"
    metrics.errors.labels(kind=kind).inc()
    context.set_trailing_metadata(((ERROR_KIND_KEY, kind),))
    await context.abort(grpc_code(error), message)


def count_call(metrics: Metrics, method: str, code: str, start: float) -> None:
    """Count a finished call and observe its latency (``start``: ``time.perf_counter()``)."""
    metrics.requests.labels(transport="grpc", method=method, code=code).inc()
    metrics.request_latency.labels(transport="grpc", method=method).observe(
        time.perf_counter() - start
    )


class _Servicer(Protocol):
    _metrics: Metrics


S = TypeVar("S", bound=_Servicer)
R = TypeVar("R")  # a request message, or a stream of them
Handler = Callable[[S, R, grpc.aio.ServicerContext], Awaitable[T]]


def unary_rpc(method: Handler[S, R, T]) -> Handler[S, R, T]:
    """Count and time a unary call; turn errors into status codes (``abort_call``)."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: S, request: R, context: grpc.aio.ServicerContext) -> T:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the method ended the call itself
        except Exception as e:
            code = grpc_code(e)
            await abort_call(context, e, self._metrics, name)
            raise  # unreachable: abort raises
        finally:
            count_call(self._metrics, name, code.name, start)

    return wrapper
