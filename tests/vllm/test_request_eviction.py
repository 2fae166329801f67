"""probkv.vllm.request_eviction: a request's eviction in a vLLM worker equals the transformers
integration's under the same policy (same observation function, same select_layers), chunked
or not, split over tensor-parallel ranks or not; decode attention against Algorithm 1."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from probkv.estimation import corrected_attention_reference
from probkv.policies import parse_method, select_layers
from probkv.scores import surrogate as sg
from probkv.scores.observation import observe_layer
from probkv.vllm.request_eviction import (
    RequestEviction,
    decode_attention,
    tensor_parallel_policy,
    visible_positions,
)

LAYERS = (0, 1, 2)
HQ, HKV, D, T, BLOCK = 4, 2, 8, 45, 4


def tensors(seed: int, t: int = T):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(h, t, D, generator=g) for h in (HQ, HKV, HKV)) for _ in LAYERS
    ]  # per layer (query, key, value)


def reference(policy, layer_tensors):
    """The transformers integration's path: observe_layer per layer, then select_layers."""
    obs = [
        observe_layer(q, k, v, scale=D**-0.5, score=policy.score, score_params=policy.score_params,
                      layer_idx=i, rank=i)[1]
        for i, (q, k, v) in zip(LAYERS, layer_tensors)
    ]  # fmt: skip
    return select_layers(policy, obs, num_layers=len(LAYERS))


def run(policy, layer_tensors, chunks, gather=None, heads=slice(None)):
    request = RequestEviction(policy, T, BLOCK, LAYERS, D**-0.5)
    bounds = [0, *chunks, T]
    for lo, hi in itertools.pairwise(bounds):
        for i, (q, k, v) in zip(LAYERS, layer_tensors):
            group = HQ // HKV
            qh = q[
                heads.start * group if heads.start else None : heads.stop * group
                if heads.stop
                else None
            ]
            request.add_chunk(i, qh[:, lo:hi], k[heads, :hi], v[heads, :hi])
    assert request.observed
    return request.select() if gather is None else request.select(gather)


METHODS = ["snapkv/window=8", "prob:snapkv/window=8", "tova", "prob:h2o", "knorm", "prob:min-h"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("chunks", [(), (20,), (7, 30, 44)])
def test_kept_prefix_equals_the_transformers_selection(method, chunks):
    policy = parse_method(f"{method}/scope=model/block={BLOCK}", 0.5)
    layer_tensors = tensors(1)
    kept = run(policy, layer_tensors, chunks)
    ref = reference(policy, layer_tensors)[0]
    positions, logw = ref.head(0)
    assert torch.equal(kept.positions, positions)
    expected = torch.zeros(positions.shape) if logw is None else logw
    torch.testing.assert_close(kept.log_weights, expected, rtol=1e-5, atol=1e-5)
    for sel in reference(policy, layer_tensors):  # one set for every layer and head
        for h in range(HKV):
            assert torch.equal(sel.head(h)[0], positions)


def kvzap_policy(method: str, ratio: float):
    """``method`` (a kvzap policy) with a random scorer of these shapes (every KV head's value
    and key pair norms -> each KV head's log-score, per layer)."""
    g = torch.Generator().manual_seed(5)
    f = HKV * (D + D // 2)
    layers = {
        i: sg.LinearSurrogate(
            torch.zeros(f), torch.ones(f), 0.5 * torch.randn(f, HKV, generator=g), -torch.ones(HKV)
        )
        for i in LAYERS
    }
    model = {"name": "toy", "shapes": {}, "digest": "0" * 16}
    policy = parse_method(f"{method}/scope=model/block={BLOCK}", ratio)
    params = {**policy.score_params, "surrogate": sg.SurrogateScorer("kv", layers, model, {})}
    return dataclasses.replace(policy, score_params=params)


@pytest.mark.parametrize("method", ["prob:kvzap", "topk:kvzap"])
@pytest.mark.parametrize("chunks", [(), (20,), (7, 30, 44)])
def test_kvzap_kept_prefix_equals_the_transformers_selection(method, chunks):
    """kvzap's scores are a function of each position's keys and values (every KV head's):
    read from the whole prompt's entries at the last chunk, they are observe_layer's."""
    policy = kvzap_policy(method, 0.5)
    layer_tensors = tensors(4)
    kept = run(policy, layer_tensors, chunks)
    positions, logw = reference(policy, layer_tensors)[0].head(0)
    assert torch.equal(kept.positions, positions)
    expected = torch.zeros(positions.shape) if logw is None else logw
    torch.testing.assert_close(kept.log_weights, expected, rtol=1e-5, atol=1e-5)
    assert kept.positions[:4].tolist() == [0, 1, 2, 3]  # the sinks are forced


@pytest.mark.parametrize("method", ["snapkv/window=8", "prob:snapkv/window=8", "prob:h2o"])
def test_two_tensor_parallel_ranks_make_the_unsplit_selection(method):
    """Each rank observes its own KV heads; gathering the heads' observations (an all-gather
    over the TP group) gives every rank the selection of the unsplit model."""
    policy = parse_method(f"{method}/scope=model/block={BLOCK}", 0.5)
    layer_tensors = tensors(2)
    recorded: list[torch.Tensor] = []

    def record(x):
        recorded.append(x)
        return x

    run(policy, layer_tensors, (20,), gather=record, heads=slice(1, 2))  # rank 1
    mine = iter(recorded)
    kept = run(policy, layer_tensors, (20,), gather=lambda x: torch.cat([x, next(mine)]),
               heads=slice(0, 1))  # fmt: skip
    ref = reference(policy, layer_tensors)[0].head(0)[0]
    assert torch.equal(kept.positions, ref)


@pytest.mark.parametrize("method", ["prob:kvzap", "topk:kvzap"])
def test_two_tensor_parallel_ranks_make_the_unsplit_kvzap_selection(method):
    """kvzap's scorer reads every KV head at a position: each rank (one KV head of two) adds
    its share of every head's prediction to the other's (the all-reduce, here the other
    rank's shares in layer order), observes its own head, and the gathered observations give
    the unsplit selection."""
    policy = kvzap_policy(method, 0.5)
    layer_tensors = tensors(6)
    shards = [tensor_parallel_policy(policy, r, 2, None).score_params["surrogate"] for r in (0, 1)]
    assert [(s.first, s.count) for s in shards] == [(0, 1), (1, 1)]
    shares = [
        [
            shard.partial(i, k[r : r + 1], v[r : r + 1])
            for i, (_, k, v) in zip(LAYERS, layer_tensors)
        ]
        for r, shard in enumerate(shards)
    ]

    def ranked(rank):
        other = iter(shares[1 - rank])
        return tensor_parallel_policy(policy, rank, 2, lambda x: x + next(other))

    recorded: list[torch.Tensor] = []
    run(ranked(1), layer_tensors, (20,), gather=lambda x: recorded.append(x) or x,
        heads=slice(1, 2))  # fmt: skip
    theirs = iter(recorded)
    kept = run(ranked(0), layer_tensors, (20,), gather=lambda x: torch.cat([x, next(theirs)]),
               heads=slice(0, 1))  # fmt: skip
    positions, logw = reference(policy, layer_tensors)[0].head(0)
    assert torch.equal(kept.positions, positions)
    expected = torch.zeros(positions.shape) if logw is None else logw
    torch.testing.assert_close(kept.log_weights, expected, rtol=1e-5, atol=1e-5)
    assert tensor_parallel_policy(policy, 0, 1, None) is policy
    with pytest.raises(ValueError, match="2 KV heads do not split over them"):
        tensor_parallel_policy(policy, 0, 4, None)


def test_freed_blocks_are_the_evicted_blocks_inside_the_prompt():
    policy = parse_method(f"knorm/scope=model/block={BLOCK}", 0.6)
    kept = run(policy, tensors(3), ())
    blocks = set((kept.positions // BLOCK).tolist())
    whole = T // BLOCK  # 11 whole blocks; the 12th (positions 44..47) takes new tokens
    assert kept.num_blocks == math.ceil(T / BLOCK)
    assert set(kept.freed) == set(range(whole)) - blocks
    assert all(b < whole for b in kept.freed)


def test_a_policy_of_another_scope_or_block_is_refused_by_name():
    with pytest.raises(ValueError, match="scope='model', block=4"):
        RequestEviction(parse_method("snapkv", 0.5), T, BLOCK, LAYERS, 1.0)
    with pytest.raises(ValueError, match="block=4"):
        RequestEviction(parse_method("snapkv/scope=model/block=8", 0.5), T, BLOCK, LAYERS, 1.0)


def test_select_before_every_layer_is_observed_names_the_layers():
    request = RequestEviction(parse_method("tova/scope=model/block=4", 0.5), T, BLOCK, LAYERS, 1.0)
    q, k, v = tensors(0)[0]
    request.add_chunk(0, q, k, v)
    with pytest.raises(ValueError, match=r"layers \[1, 2\]"):
        request.select()


def test_decode_attention_is_algorithm_1():
    policy = parse_method(f"prob:snapkv/window=8/scope=model/block={BLOCK}", 0.5)
    kept = run(policy, tensors(4), ())
    n = T + 3  # three generated tokens after the prompt
    positions, logw = visible_positions(kept, n)
    assert positions[-3:].tolist() == [T, T + 1, T + 2] and logw[-3:].tolist() == [0, 0, 0]
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    query = torch.randn(1, HQ, D, generator=g)
    out = decode_attention(query, keys[positions], values[positions], logw, scale=D**-0.5)
    k = kept.positions.numel()
    for h in range(HQ):
        kv = h // (HQ // HKV)
        ref = corrected_attention_reference(
            query[0, h], keys[positions[:k], kv], values[positions[:k], kv], logw[:k],
            keys[positions[k:], kv], values[positions[k:], kv], scale=D**-0.5,
        )  # fmt: skip
        torch.testing.assert_close(out[0, h].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["snapkv/window=8", "prob:h2o"])
def test_early_chunks_without_the_prompts_entries_give_the_same_kept_prefix(method):
    """Scores without column sums read only the last chunk's entries: early chunks may come
    without keys and values (the worker then reads nothing back from the paged cache); scores
    with column sums refuse that by name."""
    policy = parse_method(f"{method}/scope=model/block={BLOCK}", 0.5)
    layer_tensors = tensors(6)
    request = RequestEviction(policy, T, BLOCK, LAYERS, D**-0.5)
    for lo, hi in itertools.pairwise([0, 20, T]):
        for i, (q, k, v) in zip(LAYERS, layer_tensors):
            if request.needs_entries(hi):
                request.add_chunk(i, q[:, lo:hi], k[:, :hi], v[:, :hi])
            else:
                request.add_chunk(i, q[:, lo:hi], None, None, t=hi)
    assert request.needs_entries(20) == (method == "prob:h2o")
    assert torch.equal(request.select().positions, run(policy, layer_tensors, (20,)).positions)
    with pytest.raises(ValueError, match="needs the prompt's keys and values"):
        RequestEviction(policy, T, BLOCK, LAYERS, 1.0).add_chunk(
            0, layer_tensors[0][0][:, :T], None, None, t=T
        )
