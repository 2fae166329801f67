"""Every private name of vLLM that the plugin touches, in one place, read from vLLM 0.32.0.

The rest of ``probkv.vllm`` reaches vLLM's internals only through this module: when a vLLM
minor version moves one of these names, this is the one file to read again. Each function
says which vLLM source file it was read from. Public names (``vllm.LLM``,
``SamplingParams``, the ``vllm.general_plugins`` entry point, ``register_backend``) are used
directly where they are needed. Besides the functions below, ``probkv.vllm.scheduler``
overrides two private methods of vLLM's ``Scheduler`` (vllm/v1/core/sched/scheduler.py):
``_preempt_request`` and ``_free_request``, named here as ``SCHEDULER_HOOKS``.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

import numpy as np
import torch

#: The vLLM version these names were read from (``probkv.vllm.options.TESTED_VLLM``).
READ_FROM = "0.32.0"
SCHEDULER_HOOKS = ("_preempt_request", "_free_request")


# --- the CPU attention backend (vllm/v1/attention/backends/cpu_attn.py) and the cache writer
# (vllm/_custom_ops.py): probkv's backend subclasses the first, paged.py probes the layout with
# the second. Imported lazily: this module is imported only by code vLLM loads.


def cpu_attention_classes():
    """``(CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder)``."""
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
        CPUAttentionMetadataBuilder,
    )

    return CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder


def cpu_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU kernel runs (``CPUAttentionBackend.get_supported_head_sizes``)."""
    return list(cpu_attention_classes()[0].get_supported_head_sizes())


def widened_kv_specs(specs: dict, width_of) -> dict:
    """The worker's KV cache specs (``AttentionSpec``, vllm/v1/kv_cache_interface.py: frozen
    dataclasses) with keys and values ``width_of(head_size)`` wide: vLLM then sizes its pages,
    allocates its cache and builds its attention metadata for the wider heads."""
    import dataclasses

    out = {}
    for name, spec in specs.items():
        width = width_of(spec.head_size)
        out[name] = dataclasses.replace(spec, head_size=width, head_size_v=width)
    return out


def cpu_cache_writer():
    """vLLM's CPU cache writer ``cpu_attn_reshape_and_cache`` (vllm/_custom_ops.py)."""
    from vllm import _custom_ops

    return _custom_ops.cpu_attn_reshape_and_cache


# --- the worker's model runner (vllm/v1/worker/gpu_model_runner.py, gpu_input_batch.py)


def batch_request_ids(runner) -> list[str]:
    """The request of each row of the runner's current batch, in the order of the step's
    attention metadata (``runner.input_batch.req_ids``)."""
    return runner.input_batch.req_ids


@contextmanager
def no_draws_for_discarded_samples(runner):
    """Inside: the seeded requests of the runner's step whose token vLLM discards (a prefill
    chunk that ends before the prompt does: ``runner.discard_request_mask``) sample from the
    global generator, not their own, and get theirs back after. vLLM instead rewinds their
    generator afterwards (``gen.set_offset(gen.get_offset() - 4)`` in
    ``GPUModelRunner._bookkeeping_sync``), which a CPU generator refuses ("CPU Generator does
    not use offset"): the engine core died. Either way a seeded request draws from its own
    generator for its kept tokens only, so it gets the tokens it gets alone."""
    batch = runner.input_batch
    rows = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]
    held = {int(i): batch.generators.pop(int(i)) for i in rows if int(i) in batch.generators}
    try:
        yield
    finally:
        batch.generators.update(held)


def attention_layers(vllm_config) -> dict:
    """Every attention layer of the loaded model by name
    (vllm/config/__init__.py ``get_layers_from_vllm_config``)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return get_layers_from_vllm_config(vllm_config, Attention)


def backend_name(layers: dict) -> str:
    """The name of the attention backend vLLM runs in ``layers`` (``attention_layers``: each
    layer's ``attn_backend``, vllm/model_executor/layers/attention/attention.py); several are
    refused by name."""
    names = {layer.attn_backend.get_name() for layer in layers.values()}
    if len(names) != 1:
        raise RuntimeError(f"probkv: the attention layers run several backends {sorted(names)}")
    return names.pop()


def replace_metadata(common, **fields):
    """``CommonAttentionMetadata`` (vllm/v1/attention/backend.py) with ``fields`` replaced:
    its own ``replace`` (a dataclass copy; the runner's object is left as it is), without
    the values it caches from the replaced fields (``_num_computed_tokens_cache``,
    ``_token_to_req_indices_cache``: FlexAttention's query offsets come from the first)."""
    caches = {
        name: None
        for name in ("_num_computed_tokens_cache", "_token_to_req_indices_cache")
        if hasattr(common, name)
    }
    return common.replace(**fields, **caches)


# --- the scheduler's KV cache manager (vllm/v1/core/kv_cache_manager.py,
# kv_cache_coordinator.py, single_type_kv_cache_manager.py, block_pool.py) and requests
# (vllm/v1/request.py)


def free_logical_blocks(scheduler, req_id: str, logical_blocks, groups) -> int:
    """Return the request's blocks at ``logical_blocks`` of the KV cache groups ``groups``
    (indices into the coordinator's ``single_type_managers``, one per group: a hybrid model's
    full-attention groups) to the pool, leaving vLLM's null block in its block lists (what the
    sliding-window manager does with blocks that left its window); blocks another request or
    the prefix cache also holds only lose this request's reference. The number of blocks
    released."""
    released = 0
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    for manager in (managers[g] for g in groups):
        blocks = manager.req_to_blocks.get(req_id)
        if blocks is None:
            continue
        gone = []
        for i in logical_blocks:
            if i < len(blocks) and not blocks[i].is_null:
                gone.append(blocks[i])
                blocks[i] = manager._null_block
        manager.block_pool.free_blocks(gone)
        released += len(gone)
    return released


def stop_caching_new_blocks(request, *, from_start: bool = False) -> None:
    """No block of ``request`` filled from now on can be found by another request in the
    prefix cache: its block hasher (``Request._block_hasher``) is wrapped so every later hash
    is salted with the request's id (vLLM hashes, and caches, every full block, so the hashes
    cannot simply stop). A block computed after an eviction holds keys and values that
    attended the kept set, which another request with the same tokens must not reuse.
    ``from_start``: the hashes already computed (``Request.block_hashes``, the prompt's) are
    salted too, before the scheduler first looks the request up: it then shares no block with
    any other request, in either direction."""
    hasher = request._block_hasher
    if hasher is None or getattr(hasher, "probkv_salted", False):
        return
    if from_start:
        request.block_hashes.clear()
    salt = f"probkv-evicted:{request.request_id}".encode()

    def salted(req):
        return [type(h)(hashlib.sha256(salt + bytes(h)).digest()) for h in hasher(req)]

    salted.probkv_salted = True
    request._block_hasher = salted
    if from_start:
        request.update_block_hashes()


def limit_prefix_hits(scheduler, limit) -> None:
    """Wrap the scheduler's prefix-cache lookup (``KVCacheManager.get_computed_blocks``) so a
    request's hit never covers more than ``limit(request)`` tokens (None: no limit), whole
    blocks: the coordinator's ``find_longest_cache_hit`` (kv_cache_coordinator.py) is asked for
    at most that many, so every KV cache group's hit is found for the shorter length (a
    sliding-window group's hit holds the blocks of the window before its end, which cutting a
    longer hit short would miss)."""
    manager = scheduler.kv_cache_manager
    lookup, coordinator = manager.get_computed_blocks, manager.coordinator
    find = coordinator.find_longest_cache_hit
    most: list[int | None] = [None]  # the limit of the request being looked up

    def find_longest_cache_hit(block_hashes, max_cache_hit_length, *args, **kwargs):
        if most[0] is not None:
            max_cache_hit_length = min(max_cache_hit_length, max(0, most[0]))
        return find(block_hashes, max_cache_hit_length, *args, **kwargs)

    def get_computed_blocks(request):
        most[0] = limit(request)
        try:
            return lookup(request)
        finally:
            most[0] = None

    coordinator.find_longest_cache_hit = find_longest_cache_hit
    manager.get_computed_blocks = get_computed_blocks


def global_attention_layers(layers: dict) -> dict:
    """The attention layers of ``layers`` (``attention_layers``) that read the whole context:
    no ``sliding_window`` (vllm/model_executor/layers/attention/attention.py sets it per
    layer, e.g. Gemma-3's local layers)."""
    return {name: layer for name, layer in layers.items() if layer.sliding_window is None}


# --- FlexAttention (vllm/v1/attention/backends/flex_attention.py, ``AttentionCGSupport`` from
# vllm/v1/attention/backend.py, the CPU platform's backend choice in vllm/platforms/cpu.py):
# probkv.vllm.flex_backend subclasses the backend, its metadata builder and its implementation.
# Run on this CPU only; untested on a GPU.

FLEX = "FLEX_ATTENTION"


def flex_attention_classes():
    """``(FlexAttentionBackend, FlexAttentionMetadataBuilder, FlexAttentionImpl)``."""
    from vllm.v1.attention.backends.flex_attention import (
        FlexAttentionBackend,
        FlexAttentionImpl,
        FlexAttentionMetadataBuilder,
    )

    return FlexAttentionBackend, FlexAttentionMetadataBuilder, FlexAttentionImpl


def no_full_cuda_graphs():
    """``AttentionCGSupport.NEVER``, a metadata builder's ``_cudagraph_support``: vLLM then
    captures no full CUDA graph over attention (one would replay the score_mod, and its
    tables, of the step it was captured in)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    return AttentionCGSupport.NEVER


def chosen_backend(vllm_config) -> str | None:
    """The attention backend the user chose (``attention_config.backend``; None: automatic)."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return None if backend is None else backend.name


def let_flex_through(platform) -> None:
    """The CPU platform's ``get_attn_backend_cls`` returns ``CPU_ATTN`` whatever was chosen:
    wrapped so that an explicit ``FLEX_ATTENTION`` is kept (idempotent)."""
    original = platform.get_attn_backend_cls
    if getattr(original, "probkv_flex", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is not None and selected_backend.name == FLEX:
            return selected_backend.get_path()
        return original.__func__(cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls.probkv_flex = True
    platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def flex_cache_halves(kv_cache, head_size: int):
    """Keys and values of FlexAttention's cache (``[blocks, Hkv, block, 2 d]``, keys then
    values in the last dimension), each ``[blocks, Hkv, block, d]``: token-major
    (``probkv.vllm.paged.read_cache``'s ``"token"`` layout)."""
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def write_flex_cache(key, value, kv_cache, slot_mapping, head_size: int) -> None:
    """FlexAttention's cache write in torch: vLLM's ``do_kv_cache_update`` calls the CUDA op
    ``_C_cache_ops.reshape_and_cache_flash``, which vLLM's CPU build lacks. Slot ``s`` is
    block ``s // block``, offset ``s % block``; negative slots (padding) are skipped."""
    n = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.int64)
    blocks = torch.div(slots, kv_cache.shape[2], rounding_mode="floor")
    offsets = slots % kv_cache.shape[2]
    keys, values = flex_cache_halves(kv_cache, head_size)
    keys[blocks, :, offsets] = key[:n][valid].to(keys.dtype)
    values[blocks, :, offsets] = value[:n][valid].to(values.dtype)


def widen_flex_block_mask(metadata) -> None:
    """On the CPU, a step's direct-built block mask (``BlockMask.from_kv_blocks``) rebuilt so
    that torch's CPU lowering of ``flex_attention`` compiles it: vLLM sizes its ``kv_indices``
    by the step's longest sequence while the kernel's keys are the whole cache, and the
    lowering asserts that the mask covers the keys ("KV seqlen must be smaller than the
    block_mask size"): the indices are widened to every cache block (the added columns lie
    past each row's ``kv_num_blocks``, never read; the width is the same every step). vLLM
    passes no full blocks, with which torch's CPU template does not compile
    ("'full_kv_num_blocks' was not declared"): an empty set of full blocks is given."""
    from torch.nn.attention.flex_attention import BlockMask

    mask = metadata.block_mask
    if mask is None or not metadata.direct_build or mask.kv_indices.device.type != "cpu":
        return
    blocks = metadata.total_cache_tokens // metadata.kv_block_size
    width = mask.kv_indices.shape[-1]
    indices = mask.kv_indices
    if width < blocks:
        indices = torch.nn.functional.pad(indices, (0, blocks - width), value=0)
    metadata.block_mask = BlockMask.from_kv_blocks(
        mask.kv_num_blocks,
        indices,
        full_kv_num_blocks=torch.zeros_like(mask.kv_num_blocks),
        full_kv_indices=torch.zeros_like(indices),
        BLOCK_SIZE=mask.BLOCK_SIZE,
        mask_mod=mask.mask_mod,
        seq_lengths=mask.seq_lengths,
        compute_q_blocks=False,
    )


def set_flex_score_mod(metadata, score_mod) -> None:
    """Give a step's ``FlexAttentionMetadata`` a score_mod over the packed query row and the
    physical cache slot (what vLLM's kernel iterates): it is set as the metadata's
    ``transformed_score_mod``, the function vLLM's ``FlexAttentionImpl.forward`` hands to
    ``flex_attention`` (vLLM's own masks still hide other requests' and invalid slots)."""
    metadata.transformed_score_mod = score_mod
