"""The one skip reason of every test that needs CUDA (CI checks skip reasons verbatim)."""

from __future__ import annotations

import pytest

NEEDS_CUDA = "needs CUDA (not available here)"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


requires_cuda = pytest.mark.skipif(not cuda_available(), reason=NEEDS_CUDA)
