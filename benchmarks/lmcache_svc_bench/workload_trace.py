"""The workload's synthetic conversations, written as a Mooncake-style trace for
``vllm bench serve --dataset-name timed_trace`` (and the word-level tokenizer it needs).

A trace line is ``{"timestamp", "input_length", "output_length", "hash_ids"}``; vLLM's
client expands each hash id into ``block_tokens`` token ids drawn from a seed derived from
the id, so two prompts that start with the same hash ids start with the same tokens. A
conversation is a system prompt (one of a few shared ones) followed by its history: every
turn's prompt is the previous turn's prompt, that turn's answer and the new user message,
so it grows by ``turn_tokens`` a turn. Users are interleaved turn by turn (turn 1 of every
user, then turn 2 of every user, ...), so between two turns of one user the engine serves
every other user once: with more conversations than the engine's KV space holds, it has
evicted the user's history by the time the next turn comes.

Every prompt is a whole number of hash blocks: vLLM's client draws a trailing partial
block from a different seed than the same block whole, which would break the shared prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lmcache_svc_bench.vllm.bench_model import VOCAB_SIZE

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class Conversations:
    """``num_users`` conversations of ``num_turns`` turns over ``num_system_prompts``
    shared system prompts of ``system_tokens`` each; every turn adds ``turn_tokens``."""

    num_users: int
    num_turns: int
    num_system_prompts: int
    system_tokens: int
    turn_tokens: int
    output_tokens: int
    block_tokens: int

    def check(self, max_model_len: int) -> None:
        for name in ("num_users", "num_turns", "num_system_prompts", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("system_tokens", "turn_tokens"):
            value = getattr(self, name)
            if value < self.block_tokens or value % self.block_tokens:
                raise ValueError(
                    f"{name} must be a positive multiple of block_tokens "
                    f"({self.block_tokens}), got {value}"
                )
        longest = self.prompt_tokens(self.num_turns) + self.output_tokens
        if longest > max_model_len:
            raise ValueError(
                f"the last turn needs {longest} tokens > max_model_len {max_model_len}"
            )

    @property
    def num_requests(self) -> int:
        return self.num_users * self.num_turns

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length of turn ``turn`` (1-based)."""
        return self.system_tokens + turn * self.turn_tokens

    def distinct_tokens(self) -> int:
        """Tokens that would have to stay cached to never recompute a prefix."""
        return (
            self.num_system_prompts * self.system_tokens
            + self.num_users * self.num_turns * self.turn_tokens
        )


def trace_lines(c: Conversations) -> list[dict[str, object]]:
    """One entry per request, in the order the client sends them."""
    system_blocks = c.system_tokens // c.block_tokens
    turn_blocks = c.turn_tokens // c.block_tokens
    next_id = c.num_system_prompts * system_blocks
    histories: list[list[int]] = []
    for user in range(c.num_users):
        first = (user % c.num_system_prompts) * system_blocks
        histories.append(list(range(first, first + system_blocks)))
    lines: list[dict[str, object]] = []
    for _turn in range(c.num_turns):
        for history in histories:
            history.extend(range(next_id, next_id + turn_blocks))
            next_id += turn_blocks
            lines.append(
                {
                    "timestamp": len(lines),  # the order; the client runs closed-loop
                    "input_length": len(history) * c.block_tokens,
                    "output_length": c.output_tokens,
                    "hash_ids": list(history),
                }
            )
    return lines


def write_trace(path: Path, c: Conversations) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in trace_lines(c)))
    return path


def write_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer over the bench model's vocabulary (token ``i`` is the word
    ``t<i>``): vLLM's client needs one to draw the trace's token ids, the server to
    detokenize. Written as plain JSON, so it needs no tokenizer library."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE)})
    added = [
        {
            "id": i, "content": tok, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
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
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 1_000_000,
    }
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
