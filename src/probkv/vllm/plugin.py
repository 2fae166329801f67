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

from probkv.vllm import internals
from probkv.vllm import options as opts

#: The attention backends probkv evicts through on vLLM's CPU platform (None: vLLM's choice,
#: ``CPU_ATTN`` there).
BACKENDS = (None, "CPU_ATTN", internals.FLEX)

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
        if platform.__name__ != "CpuPlatform":
            raise ValueError(
                f"probkv eviction in vLLM runs on vLLM's CPU backend only, got platform "
                f"{platform.__name__}: its GPU backends take no per-position log-weight yet"
            )
        backend = internals.chosen_backend(vllm_config)
        if backend not in BACKENDS:
            raise ValueError(
                f"probkv eviction in vLLM runs on the attention backends {list(BACKENDS[1:])} "
                f"(or vLLM's automatic choice), got attention_backend={backend!r}"
            )
        engine = opts.check_engine(vllm_config)
        vllm_config.parallel_config.worker_cls = opts.WORKER
        vllm_config.scheduler_config.scheduler_cls = opts.SCHEDULER
        from probkv.vllm.admission import install
        from probkv.vllm.worker import register_attention_backend

        install(vllm_config, engine)  # each request's options checked when vLLM admits it
        if backend == internals.FLEX:  # the CPU platform would force CPU_ATTN
            internals.let_flex_through(platform)
        register_attention_backend(backend)

    setattr(check_and_update_config, _WRAPPED, True)
    platform.check_and_update_config = classmethod(check_and_update_config)
