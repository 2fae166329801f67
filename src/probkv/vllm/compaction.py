"""Compaction: an evicted request's attention reads only its kept blocks (S12), pure tensors.

After a request's eviction its block table still lists every logical block (vLLM's scheduler
puts the null block where a block was freed), and its positions stay the true ones (RoPE was
applied at them; the next token is written at its true position's slot). What attention reads
is a shorter sequence: the kept blocks of the prompt, then every block from the prompt's last
one on. ``CompactPlan`` says which; ``compact`` rewrites one step's attention metadata (block
table, sequence lengths, query starts) so that vLLM's own kernel reads exactly that: the
compact sequence of a request is its kept prompt positions followed by every position after
them, and since only whole blocks before the prompt's last one are ever evicted, a position
``p`` after the prompt sits at compact index ``p - evicted`` in the same block and offset as
vLLM's slot mapping wrote it.

A chunk that crosses the prompt's end (a request recomputed after a preemption, whose kept set
is already known) is split in two sequences of the kernel: its prompt rows read the whole
prompt causally (what they read the first time), its later rows the compact sequence.

Under a decode budget (``probkv.vllm.budget``) a request evicts again at later stages: each
stage's plan has the stage's length as its ``prompt_length`` and the plans before it as
``earlier``. A recomputed chunk is then split at every stage's length: the rows between two
stages read the compact sequence of the plan in force when they were first computed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CompactPlan:
    """Which logical blocks of a request attention reads once its prompt is evicted.

    ``prompt_length``: t; ``kept_blocks``: the kept logical blocks that lie wholly inside the
    prompt (sorted int64; blocks ``>= t // block_size`` are always read). Under a decode
    budget t is the length at the stage that made the plan, and ``earlier`` holds the plans
    of the stages before it, the prompt's first (module docstring)."""

    prompt_length: int
    kept_blocks: torch.Tensor
    block_size: int
    earlier: tuple[CompactPlan, ...] = ()

    def __post_init__(self) -> None:
        whole = self.prompt_length // self.block_size
        k = self.kept_blocks
        if k.dtype != torch.int64 or k.dim() != 1:
            raise ValueError(f"kept_blocks must be int64 [n], got {k.dtype} {tuple(k.shape)}")
        if k.numel() and (int(k.min()) < 0 or int(k.max()) >= whole or bool((k.diff() <= 0).any())):
            raise ValueError(
                f"kept_blocks must be sorted distinct blocks inside the prompt's {whole} whole "
                f"blocks, got {k.tolist()}"
            )
        lengths = [p.prompt_length for p in self.earlier] + [self.prompt_length]
        if any(a >= b for a, b in itertools.pairwise(lengths)):
            raise ValueError(f"earlier plans must end at increasing lengths, got {lengths}")

    @property
    def first_length(self) -> int:
        """The prompt's length: where the first plan starts to apply."""
        return self.earlier[0].prompt_length if self.earlier else self.prompt_length

    @property
    def evicted(self) -> int:
        """Positions attention no longer reads (whole blocks, so slots keep their offsets)."""
        return (self.prompt_length // self.block_size - self.kept_blocks.numel()) * self.block_size

    def block_index(self, width: int) -> torch.Tensor:
        """int64 ``[width]``: the logical block each compact block index reads (padded with 0
        past the table's end: those entries are never read)."""
        whole = self.prompt_length // self.block_size
        tail = torch.arange(whole, max(whole, width), dtype=torch.int64)
        out = torch.cat([self.kept_blocks, tail])
        return torch.cat([out, out.new_zeros(width - out.numel())])[:width]


@dataclass(frozen=True)
class CompactMetadata:
    """One step's attention inputs after compaction (CPU tensors, vLLM's dtypes)."""

    query_start_loc: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S]
    block_table: torch.Tensor  # [S, W]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()


def compact(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    plans: list[CompactPlan | None],
    index: torch.Tensor | None = None,
) -> CompactMetadata:
    """The kernel's inputs when the rows with a plan read only their compact sequence.

    ``query_start_loc [R + 1]``, ``seq_lens [R]`` (true lengths), ``block_table [R, W]``
    (logical -> physical); ``plans`` one per row (None: the row is read as it is). ``index``:
    ``block_indices(plans, W)`` when the caller keeps it between steps. Rows whose queries all
    lie after the prompt are gathered in one step; a row whose chunk crosses the prompt's end
    becomes two sequences (module docstring); the inputs are never modified."""
    rows = seq_lens.numel()
    if len(plans) != rows:
        raise ValueError(f"{len(plans)} plans for {rows} rows")
    qsl = query_start_loc.to(torch.int64)
    starts = seq_lens.to(torch.int64) - (qsl[1:] - qsl[:-1])  # first position of each row's chunk
    width = block_table.shape[1]
    prompt = torch.tensor([p.prompt_length if p else 0 for p in plans], dtype=torch.int64)
    evicted = torch.tensor([p.evicted if p else 0 for p in plans], dtype=torch.int64)
    first = torch.tensor([p.first_length if p else 0 for p in plans], dtype=torch.int64)
    has_plan = torch.tensor([p is not None for p in plans], dtype=torch.bool)
    after = has_plan & (starts >= prompt)  # every query after the prompt: compact
    crossing = has_plan & (starts < prompt) & (seq_lens.to(torch.int64) > first)
    if index is None:
        index = block_indices(plans, width)
    table = torch.where(after.unsqueeze(1), block_table.gather(1, index), block_table)
    lens = torch.where(after, seq_lens.to(torch.int64) - evicted, seq_lens.to(torch.int64))
    if bool(crossing.any()):
        return _split(qsl, lens, table, block_table, index, crossing, plans, seq_lens,
                      query_start_loc.dtype)  # fmt: skip
    lens = lens.to(seq_lens.dtype)
    return CompactMetadata(
        query_start_loc=query_start_loc,
        seq_lens=lens,
        block_table=table.to(block_table.dtype),
        max_query_len=int((qsl[1:] - qsl[:-1]).max()) if rows else 0,
        max_seq_len=int(lens.max()) if rows else 0,
    )


def block_indices(plans: list[CompactPlan | None], width: int) -> torch.Tensor:
    """int64 ``[R, width]``: per row, the logical block each compact block index reads (the
    identity for rows without a plan)."""
    identity = torch.arange(width, dtype=torch.int64)
    if not plans:
        return torch.zeros(0, width, dtype=torch.int64)
    return torch.stack([identity if p is None else p.block_index(width) for p in plans])


def _split(qsl, lens, table, full_table, index, crossing, plans, seq_lens, qsl_dtype):
    """``compact`` when some rows cross the prompt's end, or a stage's (after a preemption:
    rare): each crossing row becomes one sequence per plan its rows were first computed
    under, the prompt's rows one more, reading the whole prompt causally."""
    out_qsl, out_lens, out_rows = [0], [], []
    for r in range(lens.numel()):
        hi = int(qsl[r + 1])
        if not bool(crossing[r]):
            out_qsl.append(hi)
            out_lens.append(int(lens[r]))
            out_rows.append(table[r])
            continue
        plan, n = plans[r], int(seq_lens[r])
        start = n - (hi - int(qsl[r]))  # the chunk's first position
        stages = [*plan.earlier, plan]
        ends = [p.prompt_length for p in stages[1:]] + [n]
        segments = [(None, stages[0].prompt_length), *zip(stages, ends, strict=True)]
        lo_pos = 0
        for stage, end in segments:  # rows [lo_pos, end) read under ``stage`` (None: whole)
            a, b = max(lo_pos, start), min(end, n)
            lo_pos = end
            if a >= b:
                continue
            out_qsl.append(hi - (n - b))
            if stage is None:
                out_lens.append(b)
                out_rows.append(full_table[r])
            else:
                row_index = index[r] if stage is plan else stage.block_index(index.shape[1])
                out_lens.append(b - stage.evicted)
                out_rows.append(full_table[r].gather(0, row_index))
    q = torch.tensor(out_qsl, dtype=qsl_dtype)
    lens_t = torch.tensor(out_lens, dtype=seq_lens.dtype)
    return CompactMetadata(
        query_start_loc=q,
        seq_lens=lens_t,
        block_table=torch.stack(out_rows).to(full_table.dtype),
        max_query_len=int((q[1:] - q[:-1]).max()),
        max_seq_len=int(lens_t.max()),
    )
