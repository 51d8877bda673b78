"""The GPU tests import the plugin's vLLM-free modules straight from ``connectors/vllm``."""

from tests.helpers import import_plugin_from_source

import_plugin_from_source()
