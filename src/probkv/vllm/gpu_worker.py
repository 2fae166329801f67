"""vLLM's GPU worker with probkv's eviction hooks (``probkv.vllm.worker.EvictingWorker``, the
same code as the CPU worker's): set as ``worker_cls`` by ``probkv.vllm.plugin`` on a CUDA
platform, which probkv refuses unless ``PROBKV_VLLM_GPU=1`` is set, and only with
``attention_backend="FLEX_ATTENTION"`` (``probkv.vllm.flex_backend``). Not yet run on a GPU
(docs/vllm.md); imported only in a vLLM worker process."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from probkv.vllm.worker import EvictingWorker


class ProbKVGPUWorker(EvictingWorker, Worker):
    """vLLM's GPU worker with probkv's eviction state."""
