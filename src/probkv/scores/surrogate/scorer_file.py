"""The scorer file (S11): a torch file of tensors with a JSON header and a content digest
(``save_scorer``, ``load_scorer``), and the scorers shipped in the package
(``shipped_scorers``, ``SCORER_DIR``)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch

from probkv.scores.surrogate.fitted import SurrogateScorer
from probkv.scores.surrogate.form import FORM_CLASSES, FORM_TENSORS, FORMS

# Bumped when the features, targets or fit change: a file of another version is refused.
RECIPE_VERSION = 1
FILE_FORMAT = "probkv-surrogate"
# Where the package ships the scorers of its registry models: ``<model name>.pt``.
SCORER_DIR = Path(__file__).resolve().parent.parent / "scorers"


def scorer_tensors(scorer: SurrogateScorer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, layer in sorted(scorer.layers.items()):
        out.update({k: v.contiguous().cpu() for k, v in layer.tensors(f"layer{i}").items()})
    return out


def content_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, shapes and float32 bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].to(torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def save_scorer(scorer: SurrogateScorer, path: str | Path) -> str:
    """Write ``scorer`` to ``path`` (a torch file: a JSON header and the tensors); returns
    the content digest stored in the header."""
    tensors = scorer_tensors(scorer)
    header = {
        "format": FILE_FORMAT,
        "recipe_version": RECIPE_VERSION,
        "features": scorer.features,
        "form": scorer.form,
        "thresholds": scorer.thresholds,
        "layers": sorted(scorer.layers),
        "model": scorer.model,
        "recipe": scorer.recipe,
        "metrics": scorer.metrics,
        "digest": content_digest(tensors),
    }
    torch.save({"header": json.dumps(header, sort_keys=True), "tensors": tensors}, Path(path))
    return header["digest"]


def load_scorer(path: str | Path) -> SurrogateScorer:
    """Read a file written by ``save_scorer``, checking its format, recipe version and
    content digest (``ValueError`` naming the file and what is wrong)."""
    path = Path(path)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        header = json.loads(blob["header"])
        tensors = blob["tensors"]
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path}: not a probkv surrogate file ({err})") from err
    if header.get("format") != FILE_FORMAT:
        raise ValueError(f"{path}: format {header.get('format')!r}, expected {FILE_FORMAT!r}")
    if header.get("recipe_version") != RECIPE_VERSION:
        raise ValueError(
            f"{path}: recipe version {header.get('recipe_version')!r}; this probkv reads "
            f"version {RECIPE_VERSION}: train the scorer again (probkv train-scorer)"
        )
    if content_digest(tensors) != header.get("digest"):
        raise ValueError(f"{path}: content digest mismatch (the file is damaged)")
    form = header.get("form", "linear")  # files written before the MLP form are linear
    if form not in FORMS:
        raise ValueError(f"{path}: form {form!r}; this probkv reads {', '.join(FORMS)}")
    cls, names = FORM_CLASSES[form], FORM_TENSORS[form]
    layers = {i: cls(*(tensors[f"layer{i}.{k}"] for k in names)) for i in header["layers"]}
    return SurrogateScorer(
        header["features"],
        layers,
        header["model"],
        header["recipe"],
        header["metrics"],
        thresholds_of(header),
    )


def thresholds_of(header: dict) -> dict[str, float]:
    """The header's default thresholds per method; a file written before there was one per
    method carries a single ``threshold``, chosen for the top-k ``kvzap``."""
    if "thresholds" in header:
        return dict(header["thresholds"])
    old = header.get("threshold")
    return {} if old is None else {"kvzap": old}


@functools.cache
def shipped_scorers() -> tuple[SurrogateScorer, ...]:
    """Every scorer file shipped in the package (``SCORER_DIR``), read once."""
    return tuple(load_scorer(p) for p in sorted(SCORER_DIR.glob("*.pt")))


def scorer_names() -> tuple[str, ...]:
    """The registry models a scorer is shipped for (the files' names, none read)."""
    return tuple(p.stem for p in sorted(SCORER_DIR.glob("*.pt")))
