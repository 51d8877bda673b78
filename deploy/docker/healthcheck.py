"""The image's HEALTHCHECK: is the server in this container serving?

The server writes its bound addresses to ``ready_file`` once it serves (the image's config
sets /run/lmcache-svc/ready.json; another path can be the first argument). This reads
that file, so it finds the server however its ports were configured (file, environment or
flags), and asks ``GET /healthz`` on the HTTP address, or the gRPC health service on the
Unix socket when REST is off. Exit 0 = healthy.
Standard library only on the HTTP path; the gRPC path uses the server's own dependencies.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# Not an LMCACHE_SVC_* variable: the server reads every one of those as a config key.
DEFAULT_READY_FILE = "/run/lmcache-svc/ready.json"
TIMEOUT_S = 2.0
# A wildcard listen address is reached through the loopback of the same family.
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}


def _local_url(http: str) -> str:
    parts = urlsplit(http)
    host, _, port = parts.netloc.rpartition(":")
    host = _WILDCARDS.get(host, host)
    return urlunsplit((parts.scheme, f"{host}:{port}", "/healthz", "", ""))


def _check_http(http: str) -> str | None:
    url = _local_url(http)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except OSError as e:
        return f"{url}: {e}"


def _check_grpc(socket_path: str) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            return f"gRPC health on {socket_path}: {e.code().name}"
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return None if serving else f"gRPC health on {socket_path}: not serving"


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else DEFAULT_READY_FILE)
    try:
        ready = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"not ready: cannot read {path}: {e}", file=sys.stderr)
        return 1
    if "http" in ready:
        problem = _check_http(ready["http"])
    elif "socket" in ready:
        problem = _check_grpc(ready["socket"])
    else:
        problem = f"{path} names neither an HTTP address nor a socket"
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
