"""The transformers integration's greedy answer under a model-wide selection: the reference
the vLLM engine tests compare against (same policy string, same kept blocks)."""

from __future__ import annotations

import torch

from probkv.hf import ProbKVCache, prepare_model
from probkv.policies import parse_method


def hf_greedy(model, ids, method, ratio, block: int, new_tokens: int):
    """Greedy tokens, their log-probabilities and the cache of ``model`` (prepared here) on
    ``ids`` under ``method/scope=model/block=block`` at ``ratio``."""
    prepare_model(model)
    policy = parse_method(f"{method}/scope=model/block={block}", ratio)
    cache = ProbKVCache(model.config, policy, prompt_length=len(ids))
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=new_tokens,
        do_sample=False,
        cache=cache,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].double(), -1)[tok].item() for step, tok in zip(out.logits, tokens)
    ]
    return tokens, logprobs, cache
