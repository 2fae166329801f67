"""benchmarks/check_identity.py: the comparison finds any changed bit, and the dump of the
whole harness runs (the same dump twice compares equal: nothing in it depends on time or on
the temporary folder)."""

from __future__ import annotations

import torch


def test_compare_finds_a_changed_bit_a_missing_entry_and_ignores_timing(
    load_benchmark, tmp_path, capsys
):
    check = load_benchmark("check_identity")
    rows = check.canonical([{"nll": 1.5, "tokens_per_s": 9.0, "load_s": 2, "path": "/w/x"}], "/w")
    assert rows == [{"nll": 1.5, "path": "WORK/x"}]
    a = {"t": torch.tensor([1.0, 2.0]), "rows": rows}
    bumped = torch.tensor([1.0, 2.0])
    bumped[1] = torch.nextafter(bumped[1], torch.tensor(3.0))  # one ulp
    torch.save(a, tmp_path / "a.pt")
    torch.save(dict(a), tmp_path / "same.pt")
    torch.save({**a, "t": bumped}, tmp_path / "bit.pt")
    torch.save({**a, "t": a["t"].double()}, tmp_path / "dtype.pt")
    torch.save({"t": a["t"], "rows": [{"nll": 1.25, "path": "WORK/x"}]}, tmp_path / "row.pt")
    torch.save({"t": a["t"]}, tmp_path / "missing.pt")
    assert check.main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "same.pt")]) == 0
    for other in ("bit", "dtype", "row", "missing"):
        assert check.main(["compare", str(tmp_path / "a.pt"), str(tmp_path / f"{other}.pt")]) == 1
    out = capsys.readouterr().out
    assert "differs: rows at [0]/nll: 1.5 != 1.25" in out and "only in the first: rows" in out


def test_the_selection_part_of_the_dump_is_reproducible(load_benchmark):
    check = load_benchmark("check_identity")
    first, second = {}, {}
    check.dump_select(first)
    check.dump_select(second)
    assert first.keys() == second.keys() and len(first) > 100
    assert all(torch.equal(first[k], second[k]) for k in first)
