"""Errors every service raises, with their gRPC status and HTTP mapping.

grpc is imported only where a status object is needed: pure code (placement policies,
the simulator) raises these errors on machines without grpc installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


class SplitserveError(Exception):
    """Base class: carries a gRPC status (by name) and the field at fault, if any."""

    status: str = "INTERNAL"  # the name of its grpc.StatusCode
    http_status: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def code(self) -> grpc.StatusCode:
        import grpc

        return grpc.StatusCode[self.status]


class InvalidArgument(SplitserveError):
    status = "INVALID_ARGUMENT"
    http_status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(InvalidArgument):
    """A request larger than a configured size limit (HTTP 413; on gRPC the transport's own limit answers)."""

    http_status = 413


class FailedPrecondition(SplitserveError):
    """The call is well formed but this server is not in a state or kind that can serve it."""

    status = "FAILED_PRECONDITION"
    http_status = 400
    error_type = "invalid_request_error"


class Unauthenticated(SplitserveError):
    status = "UNAUTHENTICATED"
    http_status = 401
    error_type = "authentication_error"


class NotFound(SplitserveError):
    status = "NOT_FOUND"
    http_status = 404
    error_type = "invalid_request_error"


class Conflict(SplitserveError):
    """The request conflicts with state another request holds (e.g. a session's round in flight)."""

    status = "ABORTED"
    http_status = 409
    error_type = "conflict_error"


class Overloaded(SplitserveError):
    """Admission refused; the caller should retry after `retry_after_s`."""

    status = "RESOURCE_EXHAUSTED"
    http_status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(SplitserveError):
    """A dependency is down or no worker can take the request; retriable."""

    status = "UNAVAILABLE"
    http_status = 503
    error_type = "server_error"


class DeadlineExceeded(SplitserveError):
    status = "DEADLINE_EXCEEDED"
    http_status = 504
    error_type = "timeout"


class Cancelled(SplitserveError):
    status = "CANCELLED"
    http_status = 499
    error_type = "cancelled"


RETRY_AFTER_KEY = "retry-after-ms"
PARAM_KEY = "splitserve-param"  # trailing metadata: the request field at fault
# Trailing metadata on every status a splitserve handler sends (`abort`): the service itself
# answered, as opposed to a status gRPC made up because the connection failed. An answer may
# quote a connection error from further down ("failed to connect" to a worker) and still is one.
ANSWERED_KEY = "splitserve-answered"
_CONNECTION_FAILURES = ("failed to connect", "connection refused", "connection reset", "socket closed",
                        "broken pipe", "goaway", "connection attempt timed out")
MAX_DETAILS_CHARS = 512  # of a status message: sent percent-encoded in a header (soft limit 8 KiB)


async def abort(context: grpc.aio.ServicerContext, err: SplitserveError):
    """End an RPC with the error's status; overload carries a retry hint and an error naming a
    field carries its name as trailing metadata (so the field survives every hop)."""
    trailing = [(ANSWERED_KEY, "1")]
    if isinstance(err, Overloaded):
        trailing.append((RETRY_AFTER_KEY, str(int(err.retry_after_s * 1000))))
    if err.param and err.param.isascii() and err.param.isprintable():
        trailing.append((PARAM_KEY, err.param))
    context.set_trailing_metadata(tuple(trailing))
    message = err.message if err.param is None or err.param in err.message else f"{err.param}: {err.message}"
    if len(message) > MAX_DETAILS_CHARS:  # details travel in a header: a huge echoed value would break the stream
        message = message[:MAX_DETAILS_CHARS] + "..."
    await context.abort(err.code, message)


def connection_failure(err: grpc.aio.AioRpcError, channel: grpc.aio.Channel) -> bool:
    """Whether an UNAVAILABLE came from the connection to the service (down or restarting)
    rather than from the service's own answer (e.g. no eligible worker)."""
    if any(key == ANSWERED_KEY for key, _ in err.trailing_metadata() or ()):
        return False
    details = (err.details() or "").lower()
    if any(text in details for text in _CONNECTION_FAILURES):
        return True
    import grpc  # here: pure code imports this module without grpc (module docstring)

    return channel.get_state(try_to_connect=False) != grpc.ChannelConnectivity.READY


def from_rpc_error(err: grpc.aio.AioRpcError | grpc.RpcError) -> SplitserveError:
    """Rebuild a typed error from a downstream service's status, to pass it upstream."""
    code = err.code()
    details = err.details() or code.name
    # The field at fault, for the client's error body: `abort` sends it as trailing metadata
    # (never read back out of the message).
    trailing = err.trailing_metadata() or ()
    param = next((value for key, value in trailing if key == PARAM_KEY), None)
    for cls in (InvalidArgument, FailedPrecondition, Unauthenticated, NotFound, Conflict, Unavailable,
                DeadlineExceeded, Cancelled):
        if cls.status == code.name:
            return cls(details, param=param)
    if code.name == Overloaded.status:
        retry = 1.0
        for key, value in trailing:
            if key == RETRY_AFTER_KEY:
                retry = int(value) / 1000
        return Overloaded(details, retry_after_s=retry)
    return SplitserveError(details)
