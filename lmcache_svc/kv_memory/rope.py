"""Re-rotating cached keys to a new position (rotary position embeddings, RoPE).

A cached key at position p holds R(p)·k, a rotation by p·inv_freq of each pair of dimensions
(i, i + head_dim/2) (transformers' ``rotate_half`` convention, used by Llama, Mistral, Qwen2,
Qwen3). Rotations compose: R(p + d) = R(d)·R(p), so moving a whole fragment by d positions is
one more rotation by d·inv_freq, computed in float32 and cast back to the cache's dtype.

This holds when the angle is linear in the position with a fixed ``inv_freq``: RoPE types
``default``, ``linear`` and ``llama3`` (their ``inv_freq`` is fixed once from the model
config's ``rope_theta`` and scaling). Types whose frequencies depend on the sequence length
(``dynamic``, ``longrope``) or that scale cos/sin (``yarn``, any ``attention_scaling`` != 1)
are refused, as are models with a different rotation layout or partial rotary dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_svc.errors import InvalidArgument

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Models whose attention applies RoPE with rotate_half over the whole head (checked in
# their transformers modeling files); any other model type is refused rather than guessed.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Rope:
    """What re-rotation needs from a model: its inverse frequencies (float32, head_dim/2)."""

    inv_freq: torch.Tensor

    def shift_keys(self, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """``keys`` [batch, heads, seq, head_dim], rotated as if ``offset`` positions later."""
        if offset == 0:
            return keys.clone()
        half = keys.shape[-1] // 2
        angle = offset * self.inv_freq.to(torch.float64)
        cos = torch.cos(angle).to(torch.float32)
        sin = torch.sin(angle).to(torch.float32)
        k = keys.to(torch.float32)
        k1, k2 = k[..., :half], k[..., half:]
        out = torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=-1)
        return out.to(keys.dtype)


def rope_of(model: torch.nn.Module) -> Rope:
    """The model's RoPE, or ``InvalidArgument`` naming why re-rotation is not supported."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InvalidArgument(
            f"position-correct merging supports model types {SUPPORTED_MODEL_TYPES}, "
            f"not {model_type!r}"
        )
    rotary = _rotary_module(model)
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise InvalidArgument(
            f"cannot re-rotate keys for RoPE type {rope_type!r} (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}): its angles are not a fixed frequency times "
            "the position"
        )
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise InvalidArgument("cannot re-rotate keys: the model scales cos/sin (attention_scaling)")
    inv_freq = torch.as_tensor(rotary.inv_freq).detach().to(torch.float32).cpu()
    head_dim = _head_dim(config)
    if inv_freq.numel() * 2 != head_dim:
        raise InvalidArgument(
            f"cannot re-rotate keys: RoPE covers {inv_freq.numel() * 2} of {head_dim} head dims"
        )
    return Rope(inv_freq)


def _rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            return module
    raise InvalidArgument(f"{type(model).__name__} has no rotary embedding module")


def _head_dim(config: object) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(config.hidden_size) // int(config.num_attention_heads)  # type: ignore[attr-defined]
