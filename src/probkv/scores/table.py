"""The score table: every eviction score declared once (S2, S5, S6).

``SCORE_TABLE`` has one row (``ScoreSpec``) per score: its function (in
``probkv.scores.functions``), the inputs it reads, its column-sum weighting, its parameters
(the defaults policies complete ``score_params`` with, and their checks), whether its
log-scores are on the attention scale, and where its statistics come from (the prefill's
own rows, or a reconstruction pass run after prefill). The names (``SCORE_NAMES``), the
dispatch (``compute_scores``), ``column_sums_needed``, the policies' defaults
(``probkv.policies.DEFAULT_SCORE_PARAMS``), Ada-KV's scale decision (``on_attention_scale``)
and the method registry's names all derive from it. Adding a score is one function returning
``Scores`` plus one row here (docs/architecture.md has a worked example).

Log-scores are ``[Hkv, t]`` float32 and finite (``Scores``); see ``probkv.scores.functions``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from probkv._checks import check_choice, check_odd_int, check_positive_int
from probkv.scores.functions import (
    FORCED_LOG_SCORE,
    SNAPKV_GQA,
    SNAPKV_POOLING,
    Scores,
    check_layer_tensors,
    h2o,
    h2o_harmonic,
    knorm,
    min_variance,
    min_variance_harmonic,
    snapkv,
    streaming_llm,
    tova,
    uniform,
)
from probkv.scores.reconstruction import (
    DEFAULT_CHUNK_TOKENS,
    h2o_reconstruction,
    kvzip,
    kvzip_plus,
    min_reconstruction,
)
from probkv.scores.surrogate import check_scorer, kvzap

__all__ = [
    "FORCED_LOG_SCORE",
    "RECONSTRUCTION_SCORES",
    "SCORE_INPUTS",
    "SCORE_NAMES",
    "SCORE_SOURCES",
    "SCORE_TABLE",
    "SNAPKV_GQA",
    "SNAPKV_POOLING",
    "Param",
    "ScoreSpec",
    "Scores",
    "column_sums_needed",
    "compute_scores",
    "default_params",
    "h2o",
    "h2o_harmonic",
    "h2o_reconstruction",
    "knorm",
    "kvzap",
    "kvzip",
    "last_query_rows",
    "min_reconstruction",
    "min_variance",
    "min_variance_harmonic",
    "needs_reconstruction",
    "on_attention_scale",
    "score_param_names",
    "score_spec",
    "snapkv",
    "streaming_llm",
    "tensor_param_names",
    "tova",
    "uniform",
    "validate_params",
]


def _one_of(*allowed: str) -> Callable[[object, str], object]:
    return lambda value, name: check_choice(value, allowed, name)


def _non_negative(value: object, name: str) -> int:
    return check_positive_int(value, name, allow_zero=True)


def _optional_positive(value: object, name: str) -> int | None:
    return None if value is None else check_positive_int(value, name)


#: What a score function may read, by the name of its keyword: the layer's prefill tensors
#: (``query [Hq, t, d]``, ``key``/``value [Hkv, t, d]``), the logit ``scale``, the all-rows
#: ``column_sums [Hq, t]`` (or ``None``, then computed in chunks of ``chunk_size`` rows), and
#: the layer's shape (``t``, ``num_kv_heads``) and ``device`` for scores that read no tensor,
#: and the ``reconstruction`` statistics (``probkv.scores.reconstruction.ReconstructionStats``) of the
#: pass run after prefill (S10.1) for the scores whose source is ``"reconstruction"``, and
#: the model's ``layer_idx`` for scores fitted per layer (the surrogate ``kvzap``, S11).
SCORE_INPUTS: tuple[str, ...] = (
    "query",
    "key",
    "value",
    "scale",
    "column_sums",
    "chunk_size",
    "t",
    "num_kv_heads",
    "device",
    "reconstruction",
    "layer_idx",
)

#: Where a score's statistics come from: the prefill's own rows, or a reconstruction pass
#: (extra query rows run after prefill, KVzip-style; all layers must be observed first).
SCORE_SOURCES: tuple[str, ...] = ("prefill", "reconstruction")


@dataclass(frozen=True)
class Param:
    """One keyword parameter of a score: the default the policies complete ``score_params``
    with (``None``: none, the function's own applies), ``check(value, name)`` raising
    ``ValueError`` naming a bad value (``None``: checked when scores are computed), and
    whether the value is a tensor (GQA weights: Python API only, never in method names)."""

    default: object = None
    check: Callable[[object, str], object] | None = None
    tensor: bool = False


@dataclass(frozen=True)
class ScoreSpec:
    """One row of ``SCORE_TABLE``: everything the rest of probkv knows about a score.

    ``function`` returns ``Scores``; it is called with keywords only: its ``inputs`` (names
    from ``SCORE_INPUTS``) and its ``params``. ``column_sums``: the all-rows weighting it
    needs (S2; the integration computes it in its attention pass), or ``None``; such scores
    also take ``chunk_size``. ``attention_scale``: the log-scores are logs of attention
    probabilities, comparable across heads as they are (Ada-KV, S6); the others are made
    distributions per head first. ``source``: ``"prefill"`` or ``"reconstruction"``.
    ``last_rows``: how many of the last query rows the function reads (an int, or the name of
    the parameter that sets it); every other row reaches it only through ``column_sums``. A
    prefill seen in chunks keeps just these rows (``probkv.scores.observation.PrefillStatistics``).
    ``value_norm``: the function multiplies each entry's attention statistic by its value norm
    ``||v_i||_2`` (S2's minimum-variance scores ``min``, ``min-h``); a decode budget divides it
    back out of the prompt's scores to start its column sums
    (``probkv.scores.decode_statistics.DecodeStatistics.from_prompt``). Needs the ``value`` input.
    ``cross_head``: a head's score of an entry reads the other KV heads' entries at the same
    position (``kvzap``'s scorer): true at prefill, where every head holds every position, not
    after a decode stage, where each head holds its own entries. ``fixed``: an entry's score
    reads only its own position's inputs (keys and values of that position, its index for
    ``sinks``), never later rows, so it never changes once the entry is in the cache; a decode
    budget computes it once, when the entry enters (every KV head's entry of that position is
    there then), and carries it through its stages
    (``probkv.scores.decode_statistics.DecodeStatistics.enter``). A decode budget refuses a
    ``cross_head`` score that is not ``fixed``. ``output_weighted``: a reconstruction score
    that reads the pass weighted by ``||W_o^q v_i|| / ||h_u||`` (KVzip+, S11): the integration
    weighs the pass for it (``ReconstructionStats.max_weighted``).
    """

    function: Callable[..., Scores]
    inputs: tuple[str, ...]
    params: Mapping[str, Param] = field(default_factory=dict)
    column_sums: Literal["uniform", "harmonic"] | None = None
    attention_scale: bool = False
    source: Literal["prefill", "reconstruction"] = "prefill"
    last_rows: int | str = 1
    value_norm: bool = False
    cross_head: bool = False
    fixed: bool = False
    output_weighted: bool = False

    def __post_init__(self) -> None:
        # A row that cannot be called as declared fails at import, not at the first prefill.
        accepted = inspect.signature(self.function).parameters
        unknown = [x for x in (*self.inputs, *self.params) if x not in accepted]
        if unknown or not set(self.inputs) <= set(SCORE_INPUTS):
            raise ValueError(f"{self.function.__name__}: bad inputs or params {unknown}")
        if (self.column_sums is None) == ("column_sums" in self.inputs):
            raise ValueError(f"{self.function.__name__}: column_sums and inputs disagree")
        check_choice(self.source, SCORE_SOURCES, "source")
        if self.value_norm and "value" not in self.inputs:
            raise ValueError(f"{self.function.__name__}: value_norm needs the value input")
        if self.output_weighted and self.source != "reconstruction":
            raise ValueError(f"{self.function.__name__}: output_weighted reads a reconstruction")
        if self.fixed and ({"query", "column_sums", "reconstruction"} & set(self.inputs)):
            raise ValueError(f"{self.function.__name__}: a fixed score reads no query rows")
        if isinstance(self.last_rows, str):
            check_choice(self.last_rows, self.params, "last_rows")
        else:
            check_positive_int(self.last_rows, "last_rows")

    @property
    def all_params(self) -> dict[str, Param]:
        """``params``, plus ``chunk_size`` for the scores that compute column sums."""
        extra = {"chunk_size": _CHUNK_SIZE} if self.column_sums is not None else {}
        return {**self.params, **extra}


_CHUNK_SIZE = Param(check=_optional_positive)
_ALPHA = Param(tensor=True)  # GQA weights [Hq] or [Hkv, g] (S2), checked against the shapes
_SINKS = Param(4, _non_negative)
_CHUNK_TOKENS = Param(DEFAULT_CHUNK_TOKENS, check_positive_int)
_COLUMN_SUM_INPUTS = ("query", "key", "scale", "column_sums", "chunk_size")

#: Every score, in the order names are listed (``SCORE_NAMES``, method names, ``--help``).
#: Adding a score: one function returning ``Scores``, one row here (+ tests, +
#: docs/methods.md). The policies' defaults follow the functions' own (S6 window 32, max
#: pooling, kernel 7; S5 4 sinks) except SnapKV's GQA form: the methods use SnapKV's form in
#: kvpress and Ada-KV's reference code (raw group mean, which keeps each KV head's attention
#: mass for Ada-KV's comparison across heads), the function S2's group mixture.
SCORE_TABLE: dict[str, ScoreSpec] = {
    "h2o": ScoreSpec(
        h2o,
        _COLUMN_SUM_INPUTS,
        {"alpha": _ALPHA},
        column_sums="uniform",
        attention_scale=True,
    ),
    "h2o-h": ScoreSpec(
        h2o_harmonic,
        _COLUMN_SUM_INPUTS,
        {"alpha": _ALPHA},
        column_sums="harmonic",
        attention_scale=True,
    ),
    "min": ScoreSpec(
        min_variance,
        ("query", "key", "value", "scale"),
        {"alpha": _ALPHA},
        attention_scale=True,
        value_norm=True,
    ),
    "min-h": ScoreSpec(
        min_variance_harmonic,
        (*_COLUMN_SUM_INPUTS, "value"),
        {"alpha": _ALPHA},
        column_sums="harmonic",
        attention_scale=True,
        value_norm=True,
    ),
    "snapkv": ScoreSpec(
        snapkv,
        ("query", "key", "scale"),
        {
            "window": Param(32, check_positive_int),
            "kernel": Param(7, check_odd_int),
            "pooling": Param("max", _one_of(*SNAPKV_POOLING)),
            "gqa": Param("mean", _one_of(*SNAPKV_GQA)),
            "alpha": _ALPHA,
        },
        attention_scale=True,
        last_rows="window",
    ),
    "tova": ScoreSpec(tova, ("query", "key", "scale"), attention_scale=True),
    "knorm": ScoreSpec(knorm, ("key",)),
    "streaming_llm": ScoreSpec(
        streaming_llm,
        ("t", "num_kv_heads", "device"),
        {"sinks": _SINKS},
    ),
    "uniform": ScoreSpec(uniform, ("t", "num_kv_heads", "device")),
    # S10.1: read from the reconstruction pass (KVzip); 4 sinks as kvpress, KVzip's chunks
    "kvzip": ScoreSpec(
        kvzip,
        ("reconstruction",),
        {"sinks": _SINKS, "chunk_tokens": _CHUNK_TOKENS},
        attention_scale=True,
        source="reconstruction",
    ),
    # S11: KVzap's teacher, KVzip's rows weighted by ||W_o v_i|| / ||h_u||
    "kvzip-plus": ScoreSpec(
        kvzip_plus,
        ("reconstruction",),
        {"sinks": _SINKS, "chunk_tokens": _CHUNK_TOKENS},
        attention_scale=True,
        source="reconstruction",
        output_weighted=True,
    ),
    "h2o-rec": ScoreSpec(
        h2o_reconstruction,
        ("reconstruction",),
        {"sinks": _SINKS, "chunk_tokens": _CHUNK_TOKENS, "alpha": _ALPHA},
        attention_scale=True,
        source="reconstruction",
    ),
    "min-rec": ScoreSpec(
        min_reconstruction,
        ("reconstruction", "value"),
        {"sinks": _SINKS, "chunk_tokens": _CHUNK_TOKENS, "alpha": _ALPHA},
        attention_scale=True,
        source="reconstruction",
    ),
    # S11: a surrogate of kvzip, predicted per layer from the keys and values at prefill
    # (probkv.scores.surrogate); the scorer is a Python object (probkv.hf and probkv.vllm load the
    # shipped one: probkv.scores.scorer_lookup).
    # Defaults mirror kvzip's, whose scale it predicts (docs/evaluation.md, "Surrogate
    # scores (kvzap)").
    "kvzap": ScoreSpec(
        kvzap,
        ("key", "value", "layer_idx"),
        {"surrogate": Param(check=check_scorer, tensor=True), "sinks": _SINKS},
        attention_scale=True,
        cross_head=True,
        fixed=True,
    ),
}

SCORE_NAMES: tuple[str, ...] = tuple(SCORE_TABLE)
# The scores read from a reconstruction pass (S10.1): one pass gives all of them.
RECONSTRUCTION_SCORES: tuple[str, ...] = tuple(
    n for n, spec in SCORE_TABLE.items() if spec.source == "reconstruction"
)


def score_spec(name: str) -> ScoreSpec:
    """The row of score ``name`` (``ValueError`` listing the names if there is none)."""
    return SCORE_TABLE[check_choice(name, SCORE_TABLE, "name")]


def column_sums_needed(name: str) -> Literal["uniform", "harmonic"] | None:
    """Which all-rows column sums score ``name`` needs: ``"uniform"`` (``h2o``),
    ``"harmonic"`` (``h2o-h``, ``min-h``) or ``None`` (the others)."""
    return score_spec(name).column_sums


def last_query_rows(name: str, params: Mapping[str, object]) -> int:
    """How many of the last query rows score ``name`` reads with ``params`` (its row's
    ``last_rows``: SnapKV's window, 1 for the others); earlier rows only through column sums."""
    rows = score_spec(name).last_rows
    if isinstance(rows, str):
        value = params.get(rows, score_spec(name).params[rows].default)
        return check_positive_int(value, rows)
    return rows


def needs_reconstruction(name: str) -> bool:
    """Whether score ``name`` reads a reconstruction pass run after prefill (then no layer
    can be evicted before every layer was observed)."""
    return score_spec(name).source == "reconstruction"


def on_attention_scale(name: str) -> bool:
    """Whether score ``name``'s log-scores are logs of attention probabilities (S2, S6)."""
    return score_spec(name).attention_scale


def default_params(name: str) -> dict[str, object]:
    """The parameters a policy observing ``name`` uses unless told otherwise."""
    params = score_spec(name).params
    return {key: p.default for key, p in params.items() if p.default is not None}


def score_param_names(name: str) -> tuple[str, ...]:
    """Keyword parameters score ``name`` accepts in ``compute_scores(..., **params)``:
    ``alpha`` (attention scores), ``window``/``kernel``/``pooling``/``gqa`` (``snapkv``),
    ``sinks`` (``streaming_llm``), and ``chunk_size`` for the scores that need column sums."""
    return tuple(score_spec(name).all_params)


def tensor_param_names(name: str) -> tuple[str, ...]:
    """The parameters of ``name`` that take tensors (Python API only, not method names)."""
    return tuple(key for key, p in score_spec(name).all_params.items() if p.tensor)


def validate_params(name: str, params: dict[str, object]) -> None:
    """Check a score name and its parameters before any work (``ValueError`` naming the
    bad one and what is allowed). ``alpha`` is checked for shape when scores are computed."""
    allowed = score_spec(name).all_params
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        listed = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"unknown parameter(s) {unknown} for score {name!r}; allowed: {listed}")
    for key, value in params.items():
        if allowed[key].check is not None:
            allowed[key].check(value, key)


def compute_scores(
    name: str,
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor | None,
    *,
    scale: float,
    column_sums: torch.Tensor | None = None,
    chunk_size: int | None = None,
    reconstruction: object | None = None,
    layer_idx: int | None = None,
    **params: object,
) -> Scores:
    """Score ``name`` (a row of ``SCORE_TABLE``) for one layer.

    Args:
        name: one of ``SCORE_NAMES`` (``h2o``, ``h2o-h``, ``min``, ``min-h``, ``snapkv``,
            ``tova``, ``knorm``, ``streaming_llm``, ``uniform``).
        query: ``[Hq, t, d]`` (may be ``None`` for scores that read no query: ``knorm``,
            ``streaming_llm``, ``uniform``).
        key: ``[Hkv, t, d]``; value: ``[Hkv, t, d_v]`` (required by ``min``, ``min-h``).
        scale: logit scale.
        column_sums: ``[Hq, t]`` the row-weighted column sums this score needs (see
            ``column_sums_needed``), as returned by ``causal_attention_with_column_sums``
            for that weighting; passing them for a score that needs none is an error.
        chunk_size: rows per chunk when the column sums are computed here (ignored by
            scores that need no column sums).
        reconstruction: the ``ReconstructionStats`` of the layer's reconstruction pass,
            required by (and only by) the scores whose source is ``"reconstruction"`` (S10.1;
            ``probkv.hf.compress`` and ``observe`` run the pass).
        layer_idx: the layer's index in the model, read by scores fitted per layer
            (``kvzap``, S11).
        params: the row's parameters: ``alpha`` (GQA weights, attention scores),
            ``window``, ``kernel``, ``pooling``, ``gqa`` (``snapkv``), ``sinks``
            (``streaming_llm``).
    """
    spec = score_spec(name)
    validate_params(name, params)
    if column_sums is not None and spec.column_sums is None:
        users = [n for n, row in SCORE_TABLE.items() if row.column_sums is not None]
        raise ValueError(
            f"column_sums were given but score {name!r} uses none (only "
            f"{', '.join(map(repr, users))} do)"
        )
    if (reconstruction is not None) != (spec.source == "reconstruction"):
        users = [n for n, row in SCORE_TABLE.items() if row.source == "reconstruction"]
        raise ValueError(
            f"score {name!r}: reconstruction statistics are required by, and only by, the "
            f"scores {', '.join(users)} (S10.1: the pass probkv.hf.compress / observe run)"
        )
    if not isinstance(key, torch.Tensor) or key.ndim != 3:
        raise ValueError(f"key must be a [Hkv, t, d] tensor, got {getattr(key, 'shape', key)!r}")
    if "query" not in spec.inputs:
        # a score that reads no attention still refuses inconsistent layer tensors
        check_layer_tensors(key if query is None else query, key, value)
    elif query is None:
        raise ValueError(f"query is required for the {name!r} score")
    available = {
        "query": query,
        "key": key,
        "value": value,
        "scale": scale,
        "column_sums": column_sums,
        "chunk_size": chunk_size,
        "t": key.shape[1],
        "num_kv_heads": key.shape[0],
        "device": key.device,
        "reconstruction": reconstruction,
        "layer_idx": layer_idx,
    }
    return spec.function(**{x: available[x] for x in spec.inputs}, **params)
