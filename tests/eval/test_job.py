"""Running jobs with a model (probkv.eval.job): the prompt split at eviction, question-aware
eviction, and the shared-prefill fast path against one ``compress`` per job (the reference).

End to end through ``run_eval`` on tiny random models saved as Hugging Face folders
(fixtures in conftest.py).
"""

from __future__ import annotations

import pytest

from probkv.eval import Example, write_examples
from probkv.eval.job import split_prompt
from probkv.eval.runner import run_eval
from probkv.eval.store import RESULTS_FILE, read_results


def test_split_prompt():
    assert split_prompt([1, 2, 3], [4, 5], False) == ([1, 2, 3], [4, 5])
    # Question-aware: everything but the last prompt token is there at eviction time.
    assert split_prompt([1, 2, 3], [4, 5], True) == ([1, 2, 3, 4], [5])
    # An empty question still leaves one token to feed after eviction.
    assert split_prompt([1, 2, 3], [], False) == ([1, 2], [3])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        split_prompt([1], [], False)


def test_question_aware(tiny_dir, data_file, tmp_path, run_config):
    cfg = run_config(
        tiny_dir, data_file, methods=("full", "snapkv"), ratios=(0.5,), question_aware=True
    )
    run_eval(cfg, tmp_path / "qa", progress=False)
    for r in read_results(tmp_path / "qa" / RESULTS_FILE):
        assert r["question_aware"] is True
        assert r["compressed_tokens"] == r["context_tokens"] + r["question_tokens"] - 1


@pytest.mark.parametrize("arch_dir", ["tiny_dir", "tiny_gemma_dir"])
def test_shared_prefill_equals_compress(arch_dir, data_file, tmp_path, request, run_config, keyed):
    """The shared-prefill fast path gives exactly the rows of one ``probkv.hf.compress`` per
    job (the reference): same kept sets (effective ratios, per-layer reports, cache bytes) and
    the same greedy answers, for per-layer and global-scope policies, top-k and sampled."""
    model = request.getfixturevalue(arch_dir)
    methods = (
        "full",
        "snapkv",
        "ada_pyramidkv",
        "prob:min-h",
        "prob:min-h/correct=false",
        "prob:min-h/scope=global",
        "prob:min-h/sampler=with_replacement/scope=global",
    )
    cfg = run_config(model, data_file, methods=methods, ratios=(0.0, 0.25, 0.5))
    fast = run_eval(cfg, tmp_path / "fast", progress=False)
    slow = run_eval(cfg, tmp_path / "slow", progress=False, reuse_prefill=False)
    fast_rows = read_results(tmp_path / "fast" / RESULTS_FILE)
    slow_rows = read_results(tmp_path / "slow" / RESULTS_FILE)
    assert max(r["shared_prefill"] for r in fast_rows) == 3 * 4  # 4 min-h variants x 3 ratios
    assert all(r["shared_prefill"] == 1 for r in slow_rows)
    assert keyed(fast_rows) == keyed(slow_rows)
    assert fast.jobs_run == slow.jobs_run == len(fast_rows)


def test_unusable_prompt_refused_before_any_job(tiny_dir, tmp_path, make_examples, run_config):
    data = tmp_path / "data.jsonl"
    # No chat template and an empty context: the prompt is the one token "x".
    tiny = Example("one-token", "t", "", "x", ("a",), 2, chat_template=False)
    write_examples(data, [*make_examples(1), tiny])
    with pytest.raises(ValueError, match="example 'one-token': its prompt has 1 token"):
        run_eval(run_config(tiny_dir, data, methods=("full",)), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_kvzip_methods_share_one_reconstruction_pass(
    tiny_gemma_dir, data_file, tmp_path, run_config, keyed
):
    """kvzip, ada_kvzip, prob:kvzip and prob:min-rec: one prefill and one reconstruction pass
    per example and score serve every ratio (S10.1), with the rows compress gives."""
    cfg = run_config(
        tiny_gemma_dir,
        data_file,
        methods=("kvzip", "ada_kvzip", "prob:kvzip", "prob:min-rec"),
        ratios=(0.5, 0.75),
    )
    fast = run_eval(cfg, tmp_path / "fast", progress=False)
    slow = run_eval(cfg, tmp_path / "slow", progress=False, reuse_prefill=False)
    fast_rows = read_results(tmp_path / "fast" / RESULTS_FILE)
    slow_rows = read_results(tmp_path / "slow" / RESULTS_FILE)
    assert max(r["shared_prefill"] for r in fast_rows) == 3 * 2  # 3 kvzip methods x 2 ratios
    assert keyed(fast_rows) == keyed(slow_rows)
    assert fast.jobs_run == slow.jobs_run == len(fast_rows) == 3 * 4 * 2  # 3 examples
    for r in fast_rows:
        # top-k: the exact budget; pps blocks of 8 (the default): within 7 entries per head
        slack = 0.01 if not r["method"].startswith("prob:") else 7 / 400
        assert abs(r["effective_ratio"] - r["ratio"]) < slack
