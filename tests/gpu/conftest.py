"""The GPU tests import the plugin's vLLM-free modules straight from ``connectors/vllm``."""

from __future__ import annotations

import sys
from pathlib import Path

PLUGIN_DIR = Path(__file__).resolve().parents[2] / "connectors" / "vllm"
if str(PLUGIN_DIR) not in sys.path:
    sys.path.insert(0, str(PLUGIN_DIR))
