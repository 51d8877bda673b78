"""``bench routing``'s router: an HTTP proxy in front of several ``vllm serve`` that picks
an engine per request, round robin or by a KV index (NVIDIA Dynamo's standalone indexer fed
by the engines' event streams).

It reads one request (head and body), picks a backend, forwards the request with
``Connection: close`` and pipes the backend's answer (a streamed completion) back byte for
byte, then closes: no HTTP library in between, nothing buffered but the request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Policy = Callable[[list[int], list[int]], int]
"""(prompt token ids, requests in flight per backend) -> backend index."""


def round_robin() -> Policy:
    counter = itertools.count()
    return lambda tokens, in_flight: next(counter) % len(in_flight)


def by_index(indexer_url: str, timeout_s: float = 2.0, load_tokens: int = 512) -> Policy:
    """The backend with the best cost by the indexer's ``/query`` (workers numbered from
    1): prompt tokens its KV (any tier) already holds, minus ``load_tokens`` per request it
    has in flight (as Dynamo's own router weighs overlap against load), so one engine does
    not take every request of a shared system prompt; ties go to the lower index."""

    def choose(tokens: list[int], in_flight: list[int]) -> int:
        matched = [0] * len(in_flight)
        try:
            body = json.dumps({"token_ids": tokens, "model_name": "default"}).encode()
            request = urllib.request.Request(
                indexer_url + "/query", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                instances = json.loads(answer.read()).get("instances", {})
            for worker, found in instances.items():
                i = int(worker) - 1
                if 0 <= i < len(matched):
                    matched[i] = int(found.get("disk", found.get("longest_matched", 0)))
        except (OSError, ValueError):
            pass  # the index is down: load alone decides
        return max(
            range(len(in_flight)), key=lambda i: (matched[i] - load_tokens * in_flight[i], -i)
        )

    return choose


def load_vocab(model_dir: Path) -> dict[str, int]:
    """The bench model's word-level vocabulary (``workload_trace.write_tokenizer``)."""
    data = json.loads((model_dir / "tokenizer.json").read_text())
    return dict(data["model"]["vocab"])


@dataclass
class Router:
    backends: list[tuple[str, int]]
    policy: Policy
    vocab: dict[str, int]
    in_flight: list[int] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.AbstractServer | None = None
    _thread: threading.Thread | None = None

    def start(self) -> Router:
        self.in_flight = [0] * len(self.backends)
        self.routed = [0] * len(self.backends)
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", 0)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="bench-router", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tokens_of(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return [self.vocab[w] for w in str(prompt).split() if w in self.vocab]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (x.partition(":") for x in lines[1:] if x)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            i = 0
            if lines[0].startswith("POST") and body:
                tokens = self.tokens_of(json.loads(body))
                loop = asyncio.get_running_loop()
                i = await loop.run_in_executor(None, self.policy, tokens, list(self.in_flight))
            self.in_flight[i] += 1
            self.routed[i] += 1
            try:
                await self._forward(i, lines[0], headers, body, writer)
            finally:
                self.in_flight[i] -= 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _forward(
        self, i: int, request_line: str, headers: dict[str, str], body: bytes,
        writer: asyncio.StreamWriter,
    ) -> None:  # fmt: skip
        host, port = self.backends[i]
        up_reader, up_writer = await asyncio.open_connection(host, port)
        keep = {k: v for k, v in headers.items() if k not in ("connection", "host")}
        head = [request_line, f"host: {host}:{port}", "connection: close"]
        head += [f"{k}: {v}" for k, v in keep.items()]
        up_writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await up_writer.drain()
        while data := await up_reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        up_writer.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._server is not None:
            loop.call_soon_threadsafe(self._server.close)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
