"""vLLM's ExampleConnector with a prefix lookup, for the TTFT benchmark's strategy (d).

Runs inside an engine (the vLLM venv): ``kv_connector_module_path: example_prefix``.

The stock ExampleConnector (``vllm/distributed/kv_transfer/kv_connector/v1/
example_connector.py``) keys a folder of safetensors files (one per layer) by a hash of the
whole prompt cut to whole blocks, and hits only a prompt whose cut is stored: a context
stored alone never hits "context + query". This subclass keeps its storage format, its
writes and its load path (``safetensors.torch.load_file`` per layer, scattered into the KV
blocks), and changes one thing: the lookup walks back from the longest block-aligned prefix
of the prompt and hits the first one stored, so a stored context serves every query after
it. Nothing else is tuned; it is the peer "an engine that reads KV files".
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)


class ExamplePrefixConnector(ExampleConnector):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._matched_tokens: dict[str, int] = {}

    # -- scheduler side --------------------------------------------------------------

    def _stored_prefix_tokens(self, token_ids: list[int], mm_hashes: list[str]) -> int:
        """Tokens of the longest stored block-aligned prefix (0: none)."""
        num_tokens = align_to_block_size(len(token_ids) - 1, self._block_size)
        while num_tokens > 0:
            folder = self._generate_foldername_debug(
                torch.tensor(token_ids[:num_tokens]), mm_hashes, create_folder=False
            )
            if os.path.exists(folder):
                return num_tokens
            num_tokens -= self._block_size
        return 0

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        token_ids = list(request.prompt_token_ids or [])
        mm_hashes = [f.identifier for f in request.mm_features]
        num_tokens = self._stored_prefix_tokens(token_ids, mm_hashes)
        if num_tokens <= num_computed_tokens:
            return 0, False
        self._matched_tokens[request.request_id] = num_tokens
        return num_tokens - num_computed_tokens, False

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        """As the parent for new requests, loading only the matched prefix."""
        meta = ExampleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = list(new_req.prompt_token_ids or [])
            mm_hashes = [f.identifier for f in new_req.mm_features]
            if new_req.req_id in self._requests_need_load:
                num_tokens = self._matched_tokens.pop(new_req.req_id)
                # make_meta keeps align_to_block_size(len) tokens: one more token than
                # the prefix makes it keep exactly the prefix.
                meta.add_request(
                    token_ids[: num_tokens + 1], new_req.block_ids[0], self._block_size,
                    is_store=False, mm_hashes=mm_hashes,
                )  # fmt: skip
            elif not self._found_match_for_prompt(token_ids, mm_hashes):
                meta.add_request(
                    token_ids, new_req.block_ids[0], self._block_size,
                    is_store=True, mm_hashes=mm_hashes,
                )  # fmt: skip
        self._requests_need_load.clear()
        return meta
