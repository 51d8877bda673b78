"""A tiny random-weight Llama with a local word-level tokenizer, for tests and benchmarks.

Nothing is downloaded: the config, the weights (``save_pretrained``, safetensors) and a
``PreTrainedTokenizerFast`` are written to a directory, with or without a chat template.
Words are ``w0`` .. ``w{n-1}``; ``sample_text`` draws sentences of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    num_words: int = 500
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_positions: int = 8192
    initializer_range: float = 0.2
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.float32
    seed: int = 0


def build_tiny_llama(path: Path, spec: TinySpec = TinySpec(), chat_template: bool = False) -> Path:
    """Write a random-weight Llama and its tokenizer to ``path``; returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(spec.num_words, chat_template)
    rope: dict[str, Any] = {"rope_theta": spec.rope_theta}  # 4.56 and 5.x both take it
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
        **rope,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(spec.dtype)  # type: ignore[arg-type]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def word_tokenizer(num_words: int, chat_template: bool) -> PreTrainedTokenizerFast:
    """The word-level tokenizer (``w0`` .. ``w{num_words-1}`` after the special tokens)."""
    vocab = {token: index for index, token in enumerate(SPECIALS)}
    for word in range(num_words):
        vocab[f"w{word}"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sample_text(num_words: int, seed: int, vocab_words: int = 500) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(vocab_words)}" for _ in range(num_words))
