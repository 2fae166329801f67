"""Every private name of vLLM that the plugin touches, in one place, read from vLLM 0.32.0.

The rest of ``probkv.vllm`` reaches vLLM's internals only through this module: when a vLLM
minor version moves one of these names, this is the one file to read again. Each function
says which vLLM source file it was read from. Public names (``vllm.LLM``,
``SamplingParams``, the ``vllm.general_plugins`` entry point, ``register_backend``) are used
directly where they are needed.
"""

from __future__ import annotations

#: The vLLM version these names were read from (``probkv.vllm.options.TESTED_VLLM``).
READ_FROM = "0.32.0"
