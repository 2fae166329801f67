"""Which kvzap scorer (S11) fits a model: its identity, and the shipped files.

A scorer (``probkv.scores.surrogate.SurrogateScorer``) is trained for one model; its file stores
that model's identity: the config fields that fix the layers' and heads' shapes, and their
digest. ``scorer_for_config`` finds the scorer shipped in the package (``probkv/scores/scorers/``,
``probkv.scores.surrogate.shipped_scorers``) whose digest matches a config, or refuses the model
by name, listing the models that have one. ``with_scorer`` completes a ``kvzap`` policy's
``score_params`` with it, so that ``kvzap``, ``prob:kvzap`` and ``topk:kvzap`` work by name; a
scorer passed explicitly (``score_params={"surrogate": load_scorer(path)}``) is checked against
the model instead. Only config attributes are read (a transformers config, or the one vLLM
holds as ``model_config.hf_config``), so both integrations use this module.
"""

from __future__ import annotations

import dataclasses

from probkv.scores.surrogate import SurrogateScorer, config_digest, scorer_names, shipped_scorers

SCORE = "kvzap"
# The config fields that fix what a scorer reads and predicts (and the model it fits).
IDENTITY_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rope_theta",
)


def model_shapes(config) -> dict[str, object]:
    """The identity fields of a model's text config (``IDENTITY_FIELDS``; ``head_dim`` from
    ``hidden_size / num_attention_heads`` when the config has none). ``config``: a
    transformers config (its text config is read) or any object with these attributes."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if get_text is not None else config
    shapes: dict[str, object] = {}
    for name in IDENTITY_FIELDS:
        value = getattr(text, name, None)
        if name == "head_dim" and value is None:
            value = text.hidden_size // text.num_attention_heads
        if name == "rope_theta" and value is None:
            value = (getattr(text, "rope_parameters", None) or {}).get("rope_theta")
        shapes[name] = value
    return shapes


def model_identity(config, name: str) -> dict[str, object]:
    """``{"name", "shapes", "digest"}`` of a model (``name``: how the user called it)."""
    shapes = model_shapes(config)
    return {"name": name, "shapes": shapes, "digest": config_digest(shapes)}


def model_label(config) -> str:
    """A model's name for messages: its config's path or, failing that, its type."""
    return str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "?"))


def has_scorer(config) -> bool:
    """Whether a scorer is shipped for this model."""
    digest = config_digest(model_shapes(config))
    return any(s.model["digest"] == digest for s in shipped_scorers())


def scorer_for_config(config) -> SurrogateScorer:
    """The shipped scorer trained for this model (matched by its identity digest), else a
    ``ValueError`` naming the model and the models that have one."""
    digest = config_digest(model_shapes(config))
    for scorer in shipped_scorers():
        if scorer.model["digest"] == digest:
            return scorer
    have = ", ".join(scorer_names()) or "none"
    raise ValueError(
        f"score 'kvzap' has no scorer for model {model_label(config)!r} (models with a "
        f"shipped scorer: {have}); train one with `probkv train-scorer --model ... --out "
        "FILE` and pass score_params={'surrogate': probkv.scores.surrogate.load_scorer(FILE)}"
    )


def with_scorer(policy, config):
    """``policy`` with the model's kvzap scorer in its ``score_params`` (module docstring);
    other scores unchanged. (Under a decode budget each entry's kvzap score is computed once,
    when it enters the cache, from every KV head's entries of its position: ``ScoreSpec.fixed``.)"""
    if policy.score != SCORE:
        return policy
    given = policy.score_params.get("surrogate")
    if given is not None:
        given.check_model(config_digest(model_shapes(config)), model_label(config))
        return policy
    params = {**policy.score_params, "surrogate": scorer_for_config(config)}
    return dataclasses.replace(policy, score_params=params)
