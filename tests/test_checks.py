"""Shared input checks (probkv._checks): bad values are named with what is allowed."""

from __future__ import annotations

import pytest
import torch

from probkv._checks import check_token_ids


@pytest.mark.parametrize(
    "ids", [[3, 1, 2], torch.tensor([3, 1, 2]), torch.tensor([[3, 1, 2]]), (3, 1, 2)]
)
def test_token_ids_become_one_row_of_int64(ids):
    out = check_token_ids(ids, "context_ids")
    assert out.dtype == torch.int64
    assert out.tolist() == [[3, 1, 2]]


@pytest.mark.parametrize("ids", [[], torch.zeros(2, 3, dtype=torch.int64), torch.tensor(5)])
def test_token_ids_refuse_empty_or_batched_input_by_name(ids):
    with pytest.raises(ValueError, match="decode_ids must be a non-empty 1-D sequence"):
        check_token_ids(ids, "decode_ids")
