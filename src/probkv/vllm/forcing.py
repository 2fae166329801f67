"""Teacher forcing in vLLM: a logits processor that makes each request generate given tokens.

A request whose ``SamplingParams.extra_args`` has ``forced_token_ids`` (a list of token ids)
samples exactly those, one per step: every other logit of its row becomes ``-inf``. With
``logprobs=0`` and vLLM's default ``logprobs_mode`` (``raw_logprobs``: computed from the
model's logits before any processor) each step returns the log-probability the model gave
the forced token, so the continuation's negative log-likelihood is read from a generation run
under the engine's own decode path (``probkv long-decode --engine vllm``: a decode budget's
stages run as they do when the tokens are sampled). Engines get it through vLLM's public
``logits_processors`` argument (``probkv.vllm.engine.VllmRunner(forcing=True)``); other
requests pass through unchanged.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

FORCED_KEY = "forced_token_ids"


class ForcedTokens(LogitsProcessor):
    """The forcing processor (module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        forced = (getattr(sampling_params, "extra_args", None) or {}).get(FORCED_KEY)
        if forced is None:
            return
        if not isinstance(forced, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in forced
        ):
            raise ValueError(
                f"{FORCED_KEY} must be a list of token ids (ints >= 0), got {forced!r}"
            )
        if sampling_params.max_tokens is not None and sampling_params.max_tokens > len(forced):
            raise ValueError(
                f"max_tokens={sampling_params.max_tokens} exceeds the {len(forced)} "
                f"{FORCED_KEY}: set max_tokens <= {len(forced)}"
            )

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # row -> (forced, output ids)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            forced = (getattr(params, "extra_args", None) or {}).get(FORCED_KEY)
            if forced:
                self.rows[index] = (list(forced), output_ids)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if direction == MoveDirectionality.SWAP and second is not None:
                self.rows[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (forced, output_ids) in self.rows.items():
            step = len(output_ids)
            if step < len(forced):
                token = forced[step]
                kept = logits[index, token].clone()
                logits[index] = float("-inf")
                logits[index, token] = kept
        return logits
