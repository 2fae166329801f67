"""probkv's per-request options checked at admission, before a request reaches the engine core.

vLLM 0.32 runs the ``validate_params(sampling_params)`` classmethod of every custom logits
processor of an engine (``ModelConfig.logits_processors``, the public ``logits_processors``
engine argument) on each request, in the process that admits it (the API server, or the
process of ``vllm.LLM``): ``vllm/v1/engine/input_processor.py``, ``InputProcessor._validate_params``
through ``vllm/v1/sample/logits_processor/__init__.py``,
``validate_logits_processors_parameters``. A ``ValueError`` there becomes vLLM's
``VLLMValidationError`` (a client error): over HTTP that request alone gets a 400 with the
message (``vllm/v1/engine/async_llm.py`` re-raises client errors without touching the engine,
``vllm/entrypoints/serve/exception_handling/error_response.py`` maps them to 400); from
``LLM.generate`` the call raises it, after its requests already added were aborted
(``vllm/entrypoints/common/offline.py``, ``_render_and_add_requests``), and the same ``LLM``
serves on.

``install`` (called by ``probkv.vllm.plugin`` for an evicting engine) adds one such processor,
``admission_check(context)``: a class made for the engine, since ``validate_params`` sees only
the request and the check needs the engine's option, block size, model config and tensor-parallel
size (``probkv.vllm.options.check_request``). As a logits processor it does nothing. vLLM sends
the config to its other processes by pickling; the class is pickled as the call that makes it
again from its context (``copyreg``), so an engine core or a second API server process gets the
same check.

Streaming-input sessions (``AsyncLLM.generate`` with an input stream: each new chunk of the
prompt is a request marked ``resumable`` that continues the session's KV cache) are refused:
new input would attend an evicted session's kept set, which nothing here has measured or
tested. ``validate_params`` does not see the flag, and the engine core dies on a raise in its
scheduler, so ``install`` wraps ``InputProcessor.process_inputs`` (``vllm/v1/engine/
input_processor.py``), which builds every chunk's request in the admitting process: for an
evicting engine a ``resumable`` request raises ``VLLMValidationError`` there, which
``AsyncLLM`` hands to that session's caller alone (``InputStreamError``) and the engine serves on.
"""

from __future__ import annotations

import copyreg
from abc import ABCMeta
from dataclasses import dataclass

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from probkv.vllm import options as opts


@dataclass(frozen=True)
class AdmissionContext:
    """What ``check_request`` needs of the engine (its arguments after ``extra_args``)."""

    engine: opts.EngineEviction
    block_size: int
    model: object | None = None  # vLLM's hf_config: kvzap's scorer is found from it
    tensor_parallel_size: int = 1

    @classmethod
    def of(cls, vllm_config, engine: opts.EngineEviction) -> AdmissionContext:
        return cls(
            engine,
            vllm_config.cache_config.block_size,
            vllm_config.model_config.hf_config,
            getattr(vllm_config.parallel_config, "tensor_parallel_size", 1),
        )


class _AdmissionMeta(ABCMeta):
    """The metaclass of probkv's admission checks: registered with ``copyreg`` below."""


class AdmissionCheck(LogitsProcessor, metaclass=_AdmissionMeta):
    """A logits processor that changes no logits; its ``validate_params`` refuses a request
    whose probkv options the engine cannot run (module docstring). This base class has no
    engine and checks nothing: ``admission_check(context)`` makes an engine's."""

    context: AdmissionContext | None = None

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        if cls.context is None:
            return
        c = cls.context
        opts.check_request(
            getattr(sampling_params, "extra_args", None),
            c.engine,
            c.block_size,
            c.model,
            c.tensor_parallel_size,
        )

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass


def admission_check(context: AdmissionContext | None) -> type[AdmissionCheck]:
    """The admission check of one engine (``AdmissionCheck`` itself for None)."""
    if context is None:
        return AdmissionCheck
    return _AdmissionMeta(
        "EngineAdmissionCheck", (AdmissionCheck,), {"context": context, "__module__": __name__}
    )


def _reduce(cls: type[AdmissionCheck]):
    if cls is AdmissionCheck:
        return "AdmissionCheck"  # pickled by name, as any module-level class
    return admission_check, (cls.context,)


copyreg.pickle(_AdmissionMeta, _reduce)


STREAMING_REFUSAL = (
    "probkv eviction does not serve streaming-input sessions (a resumable request: its new "
    "input would attend the kept set of an evicted prompt, untested); send each turn as a "
    "request of its own, or use an engine without probkv"
)
_WRAPPED = "_probkv_refuses_streaming"


def evicting(vllm_config) -> bool:
    """Whether ``vllm_config``'s engine has an admission check of probkv's (evicts)."""
    processors = vllm_config.model_config.logits_processors or ()
    return any(
        isinstance(p, type) and issubclass(p, AdmissionCheck) and p.context is not None
        for p in processors
    )


def refuse_streaming_inputs() -> None:
    """Wrap ``InputProcessor.process_inputs`` once per process (module docstring); engines
    without probkv's check are untouched."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor.process_inputs
    if getattr(original, _WRAPPED, False):
        return

    def process_inputs(self, *args, **kwargs):
        if kwargs.get("resumable") and evicting(self.vllm_config):
            raise VLLMValidationError(STREAMING_REFUSAL, parameter="resumable", value=True)
        return original(self, *args, **kwargs)

    setattr(process_inputs, _WRAPPED, True)
    InputProcessor.process_inputs = process_inputs


def install(vllm_config, engine: opts.EngineEviction) -> type[AdmissionCheck]:
    """Add the engine's admission check to its logits processors (kept: the user's; replaced:
    an admission check of an earlier call on the same config)."""
    model_config = vllm_config.model_config
    others = [
        p
        for p in (model_config.logits_processors or ())
        if not (isinstance(p, type) and issubclass(p, AdmissionCheck))
    ]
    check = admission_check(AdmissionContext.of(vllm_config, engine))
    model_config.logits_processors = [*others, check]
    refuse_streaming_inputs()
    return check
