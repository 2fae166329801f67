"""A fitted surrogate scorer (S11): one model's fitted layers with the model's identity (a
digest of its config's shapes), the feature kind, the recipe and, where measured, default
thresholds (S11's threshold mode, chosen on training contexts)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from probkv._checks import check_choice
from probkv.scores.surrogate.form import (
    ATTENTION_FEATURE_KINDS,
    FEATURE_KINDS,
    MIN_LOG_SCORE,
    LinearSurrogate,
    MLPSurrogate,
    predict_kv,
)


def config_digest(shapes: dict[str, object]) -> str:
    """A short digest of a model's identity fields (``shapes``: JSON-able)."""
    text = json.dumps(shapes, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# The methods a scorer carries a default threshold for: the top-k and the sampled (S11).
THRESHOLD_METHODS: tuple[str, ...] = ("kvzap", "prob:kvzap")


@dataclass(frozen=True)
class SurrogateScorer:
    """One model's fitted surrogate: ``layers[layer_idx]`` per evicting layer, its ``features``
    kind, the ``model`` identity (``name``, ``shapes`` and their ``digest``) it was trained
    for, the ``recipe`` (version, teacher, training contexts, ridge alpha, form) and
    ``metrics`` measured held out; ``thresholds``: the default log-score threshold measured for
    each method (``THRESHOLD_METHODS``: ``kvzap/threshold=...`` and
    ``prob:kvzap/threshold=...``, S11; a method absent has none). Every layer has one form
    (``form``)."""

    features: str
    layers: dict[int, LinearSurrogate | MLPSurrogate]
    model: dict[str, object]
    recipe: dict[str, object]
    metrics: dict[str, object] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice(self.features, FEATURE_KINDS, "features")
        for key in ("name", "shapes", "digest"):
            if key not in self.model:
                raise ValueError(f"a scorer's model identity needs {key!r}; got {self.model}")
        kinds = {type(fit) for fit in self.layers.values()}
        if not kinds <= {LinearSurrogate, MLPSurrogate} or len(kinds) > 1:
            raise ValueError(
                "a scorer's layers must all be LinearSurrogate or all MLPSurrogate, got "
                f"{sorted(k.__name__ for k in kinds)}"
            )
        if not isinstance(self.thresholds, dict):
            raise ValueError(
                f"thresholds must be a dict method -> log-score, got {self.thresholds!r}"
            )
        for method, t in self.thresholds.items():
            check_choice(method, THRESHOLD_METHODS, "a threshold's method")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not MIN_LOG_SCORE < t < 0:
                raise ValueError(
                    f"the {method} threshold must be a log-score in ({MIN_LOG_SCORE:.3f}, 0), "
                    f"got {t!r}"
                )

    @property
    def form(self) -> str:
        """``"mlp"`` if the layers are ``MLPSurrogate``, else ``"linear"``."""
        mlp = any(isinstance(fit, MLPSurrogate) for fit in self.layers.values())
        return "mlp" if mlp else "linear"

    @property
    def name(self) -> str:
        return str(self.model["name"])

    def check_model(self, digest: str, name: str) -> None:
        """Refuse a model other than the one this scorer was trained for, by name."""
        if digest != self.model["digest"]:
            raise ValueError(
                f"the kvzap scorer {self.name!r} was trained for another model (config digest "
                f"{self.model['digest']}, shapes {self.model['shapes']}); model {name!r} has "
                f"digest {digest}: train one for it with `probkv train-scorer --model ...`"
            )

    def predict(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Layer ``layer_idx``'s predicted teacher log-scores ``[Hkv, t]`` float32 from its
        ``key``/``value [Hkv, t, d]`` (``"kv"`` features only)."""
        out = predict_kv(self.check_layer(layer_idx), key, value)  # [t, Hkv]
        if out.shape[1] != key.shape[0]:
            raise ValueError(
                f"the kvzap scorer {self.name!r} predicts {out.shape[1]} KV heads; the layer "
                f"has {key.shape[0]} (kvzap scores every KV head of a layer together)"
            )
        return out.T.clamp(MIN_LOG_SCORE, 0.0).contiguous()

    def check_layer(self, layer_idx: int) -> LinearSurrogate | MLPSurrogate:
        """Layer ``layer_idx``'s fit, refused by name when the scorer cannot score it."""
        if self.features not in ATTENTION_FEATURE_KINDS:
            raise ValueError(
                f"a scorer with features {self.features!r} cannot score inside the attention "
                f"function; it needs one of {', '.join(ATTENTION_FEATURE_KINDS)}"
            )
        if layer_idx not in self.layers:
            raise ValueError(
                f"the kvzap scorer {self.name!r} has no layer {layer_idx} (it has "
                f"{sorted(self.layers)})"
            )
        return self.layers[layer_idx]
