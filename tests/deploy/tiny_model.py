"""The tiny random-weight Llama (lmcache_svc.bench.vllm.bench_model) with a tokenizer, so
that vLLM serves it with the compose file's own command (which loads a tokenizer) and
OpenAI requests may carry text.

The tokenizer is a Hugging Face ``tokenizer.json`` written by hand: a word-level vocabulary
(``<unk>``, ``<s>``, ``</s>``, then ``w3`` ... ``w1023``, one word per token id) split on
whitespace, so a prompt of words maps to known token ids and an output decodes to them.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmcache_svc.bench.vllm.bench_model import VOCAB_SIZE, make_tiny_model

SPECIAL = ["<unk>", "<s>", "</s>"]


def word(token_id: int) -> str:
    return SPECIAL[token_id] if token_id < len(SPECIAL) else f"w{token_id}"


def text_of(token_ids: list[int]) -> str:
    return " ".join(word(t) for t in token_ids)


def make_model(directory: Path, seed: int = 0) -> Path:
    make_tiny_model(directory, seed=seed)
    vocab = {word(i): i for i in range(VOCAB_SIZE)}
    added = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, s in enumerate(SPECIAL)
    ]  # fmt: skip
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
    }))  # fmt: skip
    return directory
