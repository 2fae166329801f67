"""probkv.vllm.plugin's platform and backend checks (pure: no engine, no vLLM import): the CPU
platform evicts through CPU_ATTN or FLEX_ATTENTION, a CUDA platform only when opted in and
through FLEX_ATTENTION (its worker is vLLM's GPU worker with the same eviction hooks), every
other case refused by name."""

from __future__ import annotations

import pytest

from probkv.vllm import options as opts
from probkv.vllm.plugin import GPU_OPT_IN, GPU_WORKER, platform_worker


@pytest.mark.parametrize("backend", [None, "CPU_ATTN", "FLEX_ATTENTION"])
def test_the_cpu_platform_takes_its_backend_and_flex(backend):
    assert platform_worker("CpuPlatform", False, backend, {}) == opts.WORKER


def test_the_cpu_platform_refuses_other_backends_by_name():
    with pytest.raises(ValueError, match=r"attention_backend='TORCH_SDPA'"):
        platform_worker("CpuPlatform", False, "TORCH_SDPA", {})


def test_a_gpu_needs_the_opt_in_then_flex_attention():
    with pytest.raises(ValueError, match=rf"not yet proven on a GPU: set {GPU_OPT_IN}=1"):
        platform_worker("NvmlCudaPlatform", True, "FLEX_ATTENTION", {})
    opted = {GPU_OPT_IN: "1"}
    for backend in (None, "FLASH_ATTN"):
        with pytest.raises(ValueError, match=rf"'FLEX_ATTENTION' only .*{backend!r}"):
            platform_worker("NvmlCudaPlatform", True, backend, opted)
    assert platform_worker("NvmlCudaPlatform", True, "FLEX_ATTENTION", opted) == GPU_WORKER
    assert GPU_WORKER in opts.GPU_WORKERS  # check_engine lets the worker it sets through


def test_other_platforms_are_refused_by_name():
    with pytest.raises(ValueError, match=r"got platform RocmPlatform"):
        platform_worker("RocmPlatform", False, "FLEX_ATTENTION", {GPU_OPT_IN: "1"})
