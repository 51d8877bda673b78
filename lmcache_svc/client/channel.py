"""The client's connection to the server: one gRPC channel, its stubs, the auth metadata and
the default deadline, and the one way a unary call is made (``ClientChannel._call``)."""

from __future__ import annotations

import grpc

from lmcache_svc import errors
from lmcache_svc.client.transport import (
    Req,
    Resp,
    UnaryCall,
    auth_metadata,
    client_channel_options,
    convert_rpc_error,
    grpc_target,
)
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc


class ClientChannel:
    """The channel ``CacheClient`` and its named-memory calls share."""

    def __init__(self, address: str, *, timeout_s: float, auth_token: str | None) -> None:
        self._target = grpc_target(address)
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(auth_token)
        self._channel = grpc.insecure_channel(self._target, options=client_channel_options())
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._memories = pb_grpc.MemoryServiceStub(self._channel)

    def _call(
        self, rpc: UnaryCall[Req, Resp], request: Req, timeout_s: float | None = None
    ) -> Resp:
        """One unary call of a generated stub method, its errors as the project's exceptions."""
        try:
            return rpc(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the server answers (raises ServerUnavailable after ``timeout_s``)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise errors.ServerUnavailable(
                f"no lmcache-svc server answered at {self._target} within {timeout_s} s"
            ) from None
