"""benchmarks/bench_peers.py's pure parts, without OpenVINO or vLLM: its refusals, the peer's
``max_cache_size`` against the blocks probkv's model-wide selection really keeps, the answers
measure against ``probkv eval``'s summary, the prompts and scoring against ``probkv eval``'s
own, and the table from made-up runs."""

from __future__ import annotations

import math

import pytest
import torch

from probkv.eval.job import job_prompt_ids
from probkv.eval.tasks import generate_examples
from probkv.models import load_tokenizer
from probkv.policies import LayerObservation, TopKPolicy
from probkv.policies.base import select_layers

GOOD = ["--ov-model", "ov", "--lengths", "2048,4096", "--ratios", "0.5,0.75"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ratios", "0.5,1.0"], "each ratio must be in (0, 1), got 1.0"),
        (["--ratios", "a"], "--ratios: expected comma-separated floats, got 'a'"),
        (
            ["--start-size", "48"],
            "--start-size: a positive multiple of 32 (the peer's block), got 48",
        ),
        (["--recent-size", "0"], "--recent-size: a positive multiple of 32"),
        (["--aggregation", "MAX"], "--aggregation: one of SUM, NORM_SUM, got 'MAX'"),
        (["--methods", "snapkv,full"], "'full' is every engine's plain run already"),
        (["--lengths", "512"], "--lengths: 512 leaves the peer nothing to evict"),
        (["--per-task", "0"], "--per-task: >= 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_by_name(load_benchmark, extra, message):
    bench = load_benchmark("bench_peers")
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        bench.parse_args([*GOOD, *extra])


def test_the_model_folder_is_required(load_benchmark):
    bench = load_benchmark("bench_peers")
    with pytest.raises(SystemExit, match="--ov-model is required"):
        bench.parse_args(["--lengths", "2048"])


def _observations(t: int, layers: int = 2, heads: int = 2) -> list[LayerObservation]:
    gen = torch.Generator().manual_seed(t)
    out = []
    for layer in range(layers):
        log_scores = 3 * torch.randn(heads, t, generator=gen)
        forced = torch.zeros(heads, t, dtype=torch.bool)
        forced[:, t - 8 :] = True  # SnapKV's window: the question
        out.append(
            LayerObservation(layer, layer, log_scores, forced, torch.softmax(log_scores, -1))
        )
    return out


@pytest.mark.parametrize("t", [2000, 2048, 4071])
@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
def test_kept_blocks_are_the_blocks_the_selection_keeps(load_benchmark, t, ratio):
    """The peer's matched size counts the blocks the model-wide selection (blocks of 32, the
    vLLM plugin's) really keeps, read from its kept positions."""
    bench = load_benchmark("bench_peers")
    policy = TopKPolicy(score="snapkv", ratio=ratio, scope="model", block=32)
    sel = select_layers(policy, _observations(t), num_layers=2)[0]
    kept = sel.indices[: int(sel.lengths[0])]
    assert bench.kept_blocks(t, ratio) == len(set((kept // 32).tolist()))
    size = bench.matched_cache_size([t], ratio, 32, 128)
    assert size % 32 == 0 and size >= bench.kept_blocks(t, ratio) * 32 - 16


def test_matched_cache_size_is_the_mean_in_blocks_above_the_protected(load_benchmark):
    bench = load_benchmark("bench_peers")
    # 2048 at r = 0.75: 512 kept positions, 16 blocks; 2000: 500 -> 16 blocks (15.6 rounds up)
    assert bench.matched_cache_size([2048, 2000], 0.75, 32, 128) == 512
    assert bench.matched_cache_size([2048], 0.5, 32, 128) == 1024
    assert bench.matched_cache_size([256], 0.75, 32, 128) == 192  # start + recent + a block
    with pytest.raises(ValueError, match="at least one prompt length"):
        bench.matched_cache_size([], 0.5, 32, 128)


def test_kept_share_is_the_sum_of_min_over_the_full_total(load_benchmark):
    bench = load_benchmark("bench_peers")
    scores, full = [1.0, 0.0, 0.5, 1.0], [1.0, 1.0, 1.0, 0.0]
    assert bench.kept_share(scores, full) == pytest.approx(1.5 / 3)  # min(s, f) summed / 3
    assert math.isnan(bench.kept_share([1.0], [0.0]))
    with pytest.raises(ValueError, match="2 scores against 1 full-cache scores"):
        bench.kept_share([1.0, 1.0], [1.0])


def test_prompts_and_scores_are_probkv_evals(load_benchmark, tiny_dir):
    bench = load_benchmark("bench_peers")
    tokenizer = load_tokenizer(tiny_dir)
    args = bench.parse_args(["--ov-model", "ov", "--lengths", "768", "--tasks", "niah_single_1"])
    prompts = bench.build_prompts(args, tokenizer, 4096)
    want = generate_examples("niah_single_1", tokenizer=tokenizer, length=768, num_examples=2)
    assert [ex.id for ex, _ in prompts] == [ex.id for ex in want]
    for (_, ids), w in zip(prompts, want):
        context, question, _ = job_prompt_ids(w, tokenizer, 4096)
        assert ids == [*context, *question]
    answers = [tokenizer.encode(" " + ex.answers[0], add_special_tokens=False) for ex, _ in prompts]
    assert bench.score_answers(prompts, answers, tokenizer) == [1.0, 1.0]
    wrong = [tokenizer.encode(" nothing", add_special_tokens=False)] * 2
    assert bench.score_answers(prompts, wrong, tokenizer) == [0.0, 0.0]
    with pytest.raises(ValueError, match="1 outputs for 2 prompts"):
        bench.score_answers(prompts, answers[:1], tokenizer)


def test_the_table_puts_each_engine_over_its_own_plain_run(load_benchmark, tiny_dir):
    bench = load_benchmark("bench_peers")
    tokenizer = load_tokenizer(tiny_dir)
    args = bench.parse_args(["--ov-model", "ov", "--lengths", "768", "--tasks", "niah_single_1",
                             "--ratios", "0.75"])  # fmt: skip
    prompts = bench.build_prompts(args, tokenizer, 4096)
    right = [tokenizer.encode(" " + ex.answers[0], add_special_tokens=False) for ex, _ in prompts]
    wrong = [tokenizer.encode(" nothing", add_special_tokens=False)] * 2
    configs = bench.ov_configs(args, [len(ids) for _, ids in prompts])
    assert [c["name"] for c in configs] == ["plain", "evict r=0.75"]
    assert configs[1]["eviction"]["max_cache_size"] == 192  # 768 at r = 0.75 keeps 6 blocks
    peer = {"runs": [
        {"name": "plain", "wall_s": 2.0, "token_ids": right, "config": configs[0]},
        {"name": "evict r=0.75", "wall_s": 1.0, "token_ids": [right[0], wrong[1]],
         "config": configs[1]},
    ]}  # fmt: skip
    ours = [
        {"name": "full", "wall_s": 4.0, "token_ids": right, "kept_positions": None},
        {"name": "snapkv r=0.75", "wall_s": 5.0, "token_ids": right, "kept_positions": 190.0},
    ]
    lines, rows = bench.table(args, prompts, ours, peer, tokenizer)
    assert (
        "| probkv (vLLM) | snapkv r=0.75 | 190 | 100.0% (2 of 2; 2 right) | 0.400 | 0.80x |"
        in lines
    )
    assert (
        "| OpenVINO GenAI | evict r=0.75 | 192 | 50.0% (1 of 2; 1 right) | 2.000 | 2.00x |" in lines
    )
    assert [r["kept_share"] for r in rows] == [1.0, 1.0, 1.0, 0.5]


def test_both_engines_get_the_same_concurrency(load_benchmark):
    from probkv.vllm.engine import BLOCK_SIZE, DEFAULT_CONCURRENT  # pure: no vLLM import

    bench = load_benchmark("bench_peers")
    assert (bench.CONCURRENT, bench.BLOCK) == (DEFAULT_CONCURRENT, BLOCK_SIZE)


def test_the_docstring_gives_the_pip_line_the_script_runs(load_benchmark):
    bench = load_benchmark("bench_peers")
    assert f"<dir>/bin/pip install {bench.OV_PIP}``" in bench.__doc__
