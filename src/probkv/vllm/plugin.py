"""The ``vllm.general_plugins`` entry point: vLLM loads it in every process.

``register`` wraps the platform's ``check_and_update_config`` (the one place the plugin patches
vLLM, on the tested minor version only): an engine whose ``additional_config`` has probkv's key
is checked (``probkv.vllm.options.check_engine``: unsupported settings refused by name) and gets
probkv's worker and scheduler classes, and a logits processor that changes nothing but checks
each request's probkv options when vLLM admits it (``probkv.vllm.admission``); every other
engine is left exactly as it was. ``attention_backend="FLEX_ATTENTION"`` is kept on the CPU
platform for such an engine (``probkv.vllm.flex_backend``); any other backend is refused by name.
"""

from __future__ import annotations

import os

from probkv.vllm import internals
from probkv.vllm import options as opts

#: The attention backends probkv evicts through on vLLM's CPU platform (None: vLLM's choice,
#: ``CPU_ATTN`` there).
BACKENDS = (None, "CPU_ATTN", internals.FLEX)
GPU_OPT_IN = "PROBKV_VLLM_GPU"  # =1: a CUDA platform is let through (not yet run on a GPU)
GPU_WORKER = "probkv.vllm.gpu_worker.ProbKVGPUWorker"


def platform_worker(platform: str, is_cuda: bool, backend: str | None, environ=None) -> str:
    """The worker class for an evicting engine on ``platform`` with ``backend`` (vLLM's
    ``attention_backend``; None: automatic); what cannot run is refused by name: a CUDA
    platform without the opt-in ``PROBKV_VLLM_GPU=1`` or with a backend other than
    ``FLEX_ATTENTION`` (FlashAttention has no per-position log-weight and no compaction
    hook in probkv yet), any other platform."""
    environ = os.environ if environ is None else environ
    if platform == "CpuPlatform":
        if backend not in BACKENDS:
            raise ValueError(
                f"probkv eviction on vLLM's CPU platform runs on the attention backends "
                f"{list(BACKENDS[1:])} (or vLLM's automatic choice), got "
                f"attention_backend={backend!r}"
            )
        return opts.WORKER
    if not is_cuda:
        raise ValueError(
            f"probkv eviction in vLLM runs on the CPU platform (and, opted in, CUDA), got "
            f"platform {platform}"
        )
    if environ.get(GPU_OPT_IN) != "1":
        raise ValueError(
            f"probkv eviction on vLLM's GPU platform {platform} is not yet proven on a GPU: "
            f"set {GPU_OPT_IN}=1 to run it (benchmarks/gpu_check.sh does)"
        )
    if backend != internals.FLEX:
        raise ValueError(
            f"probkv eviction on a GPU runs through attention_backend='{internals.FLEX}' only "
            f"(its metadata builder compacts and its score_mod adds the log-weights), got "
            f"attention_backend={backend!r}"
        )
    return GPU_WORKER


_WRAPPED = "_probkv_wrapped"


def register() -> None:
    import vllm
    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.check_and_update_config
    if getattr(original, _WRAPPED, False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        original.__func__(cls, vllm_config)
        extra = getattr(vllm_config, "additional_config", None) or {}
        if opts.KEY not in extra:
            return
        opts.check_version(vllm.__version__)
        backend = internals.chosen_backend(vllm_config)
        worker_cls = platform_worker(platform.__name__, current_platform.is_cuda(), backend)
        engine = opts.check_engine(vllm_config)
        vllm_config.parallel_config.worker_cls = worker_cls
        vllm_config.scheduler_config.scheduler_cls = opts.SCHEDULER
        from probkv.vllm.admission import install
        from probkv.vllm.worker import register_attention_backend

        install(vllm_config, engine)  # each request's options checked when vLLM admits it
        if backend == internals.FLEX and worker_cls == opts.WORKER:  # CPU forces CPU_ATTN
            internals.let_flex_through(platform)
        register_attention_backend(backend)

    setattr(check_and_update_config, _WRAPPED, True)
    platform.check_and_update_config = classmethod(check_and_update_config)
