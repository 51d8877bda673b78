"""Engines measured side by side: every engine up at once, the requests alternating
between them in a rotating order, in rounds of fresh engines started in a rotated order.

On a small host the TTFT of the same request drifts by milliseconds between runs, and an
engine process carries a bias of its own (on one 2-vCPU host two identical engines differed
by 2-4 ms at the median, the one started first the slower). Alternating queries puts each
query's TTFTs on the different engines within seconds of each other; rotating the order of
the queries and of the starts spreads what is left over every engine alike.
"""

from __future__ import annotations

from collections.abc import Sequence

IDLE_S = 1.3
"""The wait before each request: vLLM's shared-memory readers busy-loop for a second after
each read (``SpinCondition`` in vLLM's ``shm_broadcast.py``), so an engine that just ran
would take the CPU from the next one. Each request finds its engine idle, as a request to a
quiet server does."""


def rotated(names: Sequence[str], k: int) -> tuple[str, ...]:
    """``names`` rotated left by ``k``: over any ``len(names)`` consecutive ``k`` each name
    comes once in every place."""
    k %= len(names)
    return tuple(names[k:]) + tuple(names[:k])


def round_queries(r: int, rounds: int, num_queries: int) -> range:
    """The queries of round ``r`` of ``rounds``: consecutive, as even a share as can be."""
    return range(r * num_queries // rounds, (r + 1) * num_queries // rounds)


def check_rounds(rounds: int, num_queries: int) -> None:
    if not 1 <= rounds <= num_queries:
        raise ValueError(f"engine_rounds must be 1 to num_queries ({num_queries}), got {rounds}")
