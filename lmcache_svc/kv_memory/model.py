"""The local Hugging Face model behind ``KVCacheMemory``: loading, identity, encoding, runs.

Encoding rule (the same for ``extract`` and for generation, so a memory followed by a query
is exactly the token sequence the prompt-based path would run):

- With a chat template: a memory's text becomes one ``system`` message (a list of strings is
  joined with spaces; a list of message dicts is used as is) and is rendered with
  ``add_generation_prompt=False``. A query (a string becomes one ``user`` message) is
  rendered on its own with ``add_generation_prompt`` from the config (default True), and a
  leading ``bos_token`` the template writes is removed, since the query continues a
  sequence. Rendered text is tokenized with ``add_special_tokens=False`` (the template
  already wrote the special tokens it wants).
- Without a chat template: a memory's text is encoded as is with the tokenizer's special
  tokens (a BOS if the tokenizer adds one); a query is encoded as is without them. Message
  dicts need a chat template.

The prompt-based equivalent of memories m1..mk then a query q is ``ids(m1)+...+ids(mk)+ids(q)``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.kv_memory.cache_layers import build_cache, cache_layers

Source = str | Sequence[str] | Sequence[dict[str, Any]]
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


@dataclass(frozen=True, slots=True)
class Generation:
    token_ids: list[int]
    first_logits: torch.Tensor
    """Float32 logits of the first generated position (what TTFT waits for)."""


class LocalModel:
    def __init__(self, path: str, add_generation_prompt: bool = True) -> None:
        dtype_kw = "dtype" if TRANSFORMERS_MAJOR >= 5 else "torch_dtype"
        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, **{dtype_kw: "auto"}
        )
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.add_generation_prompt = add_generation_prompt
        self.identity = model_identity(path, self.model)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    # -- encoding -----------------------------------------------------------------------

    def memory_ids(self, source: Source) -> list[int]:
        if not self.has_chat_template:
            return self._encode(_plain_text(source), special=True)
        rendered = self._render(_as_messages(source, "system"), generation_prompt=False)
        return self._encode(rendered, special=False)

    def query_ids(self, query: Source) -> list[int]:
        if not self.has_chat_template:
            return self._encode(_plain_text(query), special=False)
        rendered = self._render(_as_messages(query, "user"), self.add_generation_prompt)
        bos = self.tokenizer.bos_token
        if bos and rendered.startswith(bos):
            rendered = rendered[len(bos) :]
        return self._encode(rendered, special=False)

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        rendered = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(rendered)

    def _encode(self, text: str, special: bool) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        if not ids:
            raise InvalidArgument("the text encodes to no tokens")
        return [int(t) for t in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # -- runs ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, ids: Sequence[int]) -> DynamicCache:
        """The KV cache of ``ids`` (one forward pass), as a fresh ``DynamicCache``."""
        out = self.model(input_ids=torch.tensor([list(ids)]), use_cache=True)
        return build_cache(cache_layers(out.past_key_values))

    @torch.no_grad()
    def generate(
        self, ids: Sequence[int], past: DynamicCache | None, max_new_tokens: int
    ) -> Generation:
        """Greedy tokens after ``ids``; with ``past``, its tokens are the first of ``ids``.

        ``past`` is extended in place by the run: pass a copy of anything stored.
        """
        start = 0 if past is None else past.get_seq_length()
        if start >= len(ids):
            raise InvalidArgument(f"the cache holds {start} tokens, the input only {len(ids)}")
        cache = past if past is not None else DynamicCache()
        step = torch.tensor([list(ids)[start:]])
        out_ids: list[int] = []
        first: torch.Tensor | None = None
        eos = self.tokenizer.eos_token_id
        for _ in range(max_new_tokens):
            logits = self.model(input_ids=step, past_key_values=cache, use_cache=True).logits
            last = logits[0, -1].float()
            first = last if first is None else first
            token = int(torch.argmax(last))
            out_ids.append(token)
            if token == eos:
                break
            step = torch.tensor([[token]])
        assert first is not None
        return Generation(out_ids, first)


def model_identity(path: str, model: torch.nn.Module) -> str:
    """``<dir name>@<hash>`` of config.json's bytes and a sample of the input embeddings.

    Stable across processes and transformers versions; differs for another config or
    other weights (two random-weight models with one config included).
    """
    digest = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        digest.update(f.read())
    embed = model.get_input_embeddings().weight.detach()  # type: ignore[operator]
    digest.update(embed.flatten()[:4096].to(torch.float32).numpy().tobytes())
    name = os.path.basename(os.path.normpath(path))
    return f"{name}@{digest.hexdigest()[:16]}"


def _plain_text(source: Source) -> str:
    if isinstance(source, str):
        return source
    if all(isinstance(s, str) for s in source):
        return " ".join(source)  # type: ignore[arg-type]
    raise InvalidArgument("chat messages need a tokenizer with a chat template; pass text")


def _as_messages(source: Source, role: str) -> list[dict[str, Any]]:
    if isinstance(source, str):
        return [{"role": role, "content": source}]
    items = list(source)
    if items and all(isinstance(s, str) for s in items):
        return [{"role": role, "content": " ".join(items)}]  # type: ignore[arg-type]
    if items and all(isinstance(m, dict) and "role" in m and "content" in m for m in items):
        return items  # type: ignore[return-value]
    raise InvalidArgument("expected text, a list of strings or a list of chat messages")
