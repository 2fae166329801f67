"""``probkv eval --batch-size N`` (probkv.eval.batching): the rows of batch size 1.

Examples of the same jobs run as one left-padded batch, each evicted on its own; the rows
(predictions under greedy decoding, kept counts, bytes, ratios, per-layer rows) are those of
one example at a time, timings aside. On tiny random models saved as folders (conftest.py).
"""

from __future__ import annotations

import pytest

from probkv.eval.batching import plan_batches
from probkv.eval.config import FULL
from probkv.eval.plan import Unit
from probkv.eval.runner import run_eval
from probkv.eval.store import RESULTS_FILE, read_results


def _rows_equal(one: dict, many: dict) -> None:
    assert one.keys() == many.keys()
    for key, row in one.items():
        other = many[key]
        for field, value in row.items():
            if isinstance(value, float):
                assert other[field] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, field)
            else:
                assert other[field] == value, (key, field)


@pytest.mark.parametrize("reuse", [True, False])
def test_batch_size_4_gives_the_rows_of_batch_size_1(
    tiny_dir, data_file, tmp_path, run_config, keyed, reuse
):
    cfg = run_config(tiny_dir, data_file)
    one = run_eval(cfg, tmp_path / "one", progress=False, reuse_prefill=reuse)
    many = run_eval(cfg, tmp_path / "many", progress=False, reuse_prefill=reuse, batch_size=4)
    assert one.jobs_run == many.jobs_run
    _rows_equal(
        keyed(read_results(tmp_path / "one" / RESULTS_FILE)),
        keyed(read_results(tmp_path / "many" / RESULTS_FILE)),
    )


def test_reconstruction_scores_batch_with_the_rows_of_batch_size_1(
    tiny_dir, data_file, tmp_path, run_config, keyed
):
    """kvzip's pass runs for the batch (one forward per round of chunks), as alone."""
    cfg = run_config(tiny_dir, data_file, methods=("kvzip", "prob:kvzip"), ratios=(0.5,))
    one = run_eval(cfg, tmp_path / "one", progress=False)
    many = run_eval(cfg, tmp_path / "many", progress=False, batch_size=4)
    assert one.jobs_run == many.jobs_run
    _rows_equal(
        keyed(read_results(tmp_path / "one" / RESULTS_FILE)),
        keyed(read_results(tmp_path / "many" / RESULTS_FILE)),
    )


def test_gemma_batches_only_questions_of_one_length(
    tiny_gemma_dir, data_file, tmp_path, run_config, keyed
):
    cfg = run_config(tiny_gemma_dir, data_file, methods=("full", "snapkv"), ratios=(0.5,))
    run_eval(cfg, tmp_path / "one", progress=False)
    run_eval(cfg, tmp_path / "many", progress=False, batch_size=3)
    _rows_equal(
        keyed(read_results(tmp_path / "one" / RESULTS_FILE)),
        keyed(read_results(tmp_path / "many" / RESULTS_FILE)),
    )


def test_plan_batches_groups_same_jobs(make_examples):
    examples = make_examples(num=3)
    snap = (("snapkv", 0.5),)
    units = [Unit(ex, jobs) for ex in examples for jobs in (((FULL, 0.0),), snap)]
    units += [Unit(ex, (("kvzip", 0.5),)) for ex in examples]
    batches = plan_batches(units, 2)
    sizes = [(b[0].jobs, len(b)) for b in batches]
    assert sizes[:4] == [(((FULL, 0.0),), 2), (snap, 2), (((FULL, 0.0),), 2), (snap, 2)]
    assert [len(b) for b in batches if b[0].jobs == (("kvzip", 0.5),)] == [2, 2]
    assert sum(len(b) for b in batches) == len(units)
    by_length = plan_batches(units[:4], 4, lambda unit: examples.index(unit.example) % 2)
    assert all(len({examples.index(u.example) % 2 for u in b}) == 1 for b in by_length)
