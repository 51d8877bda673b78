"""The chat-template rule, and greedy generation with an injected memory vs the prompt path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.kv_memory import KVCacheMemory
from lmcache_svc.kv_memory.model import LocalModel
from lmcache_svc.kv_memory.tiny_model import sample_text


def test_without_a_chat_template_text_is_encoded_as_is(plain_model: LocalModel) -> None:
    tok = plain_model.tokenizer
    assert plain_model.memory_ids("w1 w2") == [
        tok.bos_token_id,
        *tok.convert_tokens_to_ids(["w1", "w2"]),
    ]
    assert plain_model.query_ids("w3") == tok.convert_tokens_to_ids(["w3"])
    with pytest.raises(InvalidArgument, match="chat template"):
        plain_model.memory_ids([{"role": "user", "content": "w1"}])


def test_with_a_chat_template_memory_and_query_are_rendered_by_it(chat_model: LocalModel) -> None:
    tok = chat_model.tokenizer
    ids = chat_model.memory_ids("w1 w2")
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "<|system|>", "w1", "w2", "<|end|>"]
    # The query continues the sequence: the template's BOS is dropped, the generation
    # prompt added.
    query = chat_model.query_ids("w3")
    assert tok.convert_ids_to_tokens(query) == ["<|user|>", "w3", "<|end|>", "<|assistant|>"]
    messages = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    tokens = tok.convert_ids_to_tokens(chat_model.memory_ids(messages))
    assert tokens == ["<s>", "<|user|>", "w1", "<|end|>", "<|assistant|>", "w2", "<|end|>"]


def _margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("tokenizer", ["plain", "chat"])
def test_greedy_output_with_one_injected_memory_matches_the_prompt_path(
    make_memory: Callable[..., KVCacheMemory],
    plain_model: LocalModel,
    chat_model: LocalModel,
    tokenizer: str,
) -> None:
    memory = make_memory(plain_model if tokenizer == "plain" else chat_model)
    background = memory.extract(sample_text(120, 11))
    other = memory.extract(sample_text(120, 12))
    memory.add([background, other])
    query = sample_text(12, 13)
    injected = memory.generate_ids(query, [background.id], max_new_tokens=12)
    prompted = memory.generate_ids(query, [background.id], inject=False, max_new_tokens=12)
    assert injected.token_ids == prompted.token_ids
    assert len(injected.token_ids) >= 3  # 12, or up to an EOS
    torch.testing.assert_close(injected.first_logits, prompted.first_logits, atol=1e-4, rtol=1e-4)
    # Wide margins: float rounding (about 1e-5 here) cannot flip the first token.
    assert _margin(prompted.first_logits) > 1e-2
    # Control: another memory under the same query changes the output.
    control = memory.generate_ids(query, [other.id], max_new_tokens=12)
    assert control.token_ids != injected.token_ids
    assert memory.generate(query, [background.id], max_new_tokens=12) == memory.llm.decode(
        prompted.token_ids
    )
