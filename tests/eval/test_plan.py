"""Planning (probkv.eval.plan): jobs of one example that observe the same score share a unit."""

from __future__ import annotations

from probkv.eval.config import RunConfig
from probkv.eval.plan import job_key, plan_units


def test_plan_groups_jobs_sharing_an_observation(make_examples, run_methods):
    ex = make_examples(1)[0]
    jobs = RunConfig(
        model="m", methods=(*run_methods, "h2o"), ratios=(0.25, 0.5), data="x"
    ).jobs_per_example()
    units = plan_units([ex], jobs)
    groups = sorted(sorted(u.jobs) for u in units)
    assert [("full", 0.0)] in groups
    assert sorted([("snapkv", 0.25), ("snapkv", 0.5)]) in groups
    assert sorted([("h2o", 0.25), ("h2o", 0.5)]) in groups
    # min-h's observation does not depend on correction, scope or ratio: one prefill for 6 jobs.
    minh = [j for j in jobs if j[0].startswith("prob:min-h")]
    assert sorted(minh) in groups
    assert sum(len(u.jobs) for u in units) == len(jobs)
    done = {job_key(ex.id, "snapkv", 0.25), job_key(ex.id, "full", 0.0)}
    left = plan_units([ex], jobs, done)
    assert sum(len(u.jobs) for u in left) == len(jobs) - 2
    assert all(len(u.jobs) == 1 for u in plan_units([ex], jobs, reuse_prefill=False))
