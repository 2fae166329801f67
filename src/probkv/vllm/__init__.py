"""probkv inside vLLM (``pip install 'probkv[vllm]'``): model-wide block eviction after each
request's prefill, the freed blocks returned to vLLM's pool, and the importance weights added
to the logits of every later decode step (S4, S11). Switched on per engine by
``additional_config={"probkv": {"method": NAME, "ratio": R}}``; see docs/vllm.md.

Importing this package imports nothing of vLLM: ``options`` and ``requests`` are pure Python
and tensors; ``plugin``, ``backend``, ``worker`` and ``scheduler`` are loaded by vLLM.
"""

from probkv.vllm.options import KEY, check_engine, policy_for, request_options

__all__ = ["KEY", "check_engine", "engine_options", "policy_for", "request_options"]


def engine_options(
    method: str,
    ratio: float,
    *,
    report: str | None = None,
    block_size: int = 32,
    log_weights: bool | None = None,
    max_entries: int | None = None,
    every: int | None = None,
) -> dict:
    """Keyword arguments of ``vllm.LLM`` (or ``EngineArgs``) that switch probkv on:
    ``LLM(model, **engine_options("snapkv", 0.5))``. Prefix caching stays as the engine
    has it (vLLM's default: on; probkv.vllm.scheduler says how eviction shares it); ``block_size`` 32 is the smallest block
    vLLM's CPU backend takes (its default is 128), and smaller blocks lose fewer answers
    (docs/evaluation.md, model-wide blocks). ``log_weights``: whether the KV cache holds the
    log-weights that ``prob:`` requests need (spare key columns: 1.25x the bytes per position
    for 64-wide heads); None: when ``method`` is a ``prob:`` one. ``max_entries`` B and
    ``every`` K: a decode budget for every request that does not set its own
    (``probkv.vllm.budget``)."""
    from probkv.vllm.options import read_options

    raw = {"method": method, "ratio": ratio, **({"report": report} if report else {})}
    if log_weights is not None:
        raw["log_weights"] = log_weights
    if max_entries is not None:
        raw["max_entries"] = max_entries
    if every is not None:
        raw["every"] = every
    read_options(raw)
    return {
        "additional_config": {KEY: raw},
        "block_size": block_size,
    }
