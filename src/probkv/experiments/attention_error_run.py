"""One run of the attention-error experiment (``probkv attention-error``, S7), typed.

:class:`AttentionErrorRun` holds what a run measures (the estimators of
:func:`probkv.experiments.attention_error.measure_attention_error`) and on which prompt;
:func:`run_attention_error` checks everything the run was given before the model loads (an
unwritable output, a prompt past the model's positions), measures and writes one JSON file
``{"header": {...}, "rows": [...]}`` (the rows and every number's meaning are documented in
:mod:`probkv.experiments.attention_error` and repeated in the header's ``definitions``).
``probkv plot`` draws them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from probkv.eval.outputs import check_output_file, write_json
from probkv.experiments import attention_error as ae
from probkv.experiments.paper_prompt import PAPER_QUESTION, PAPER_TEXT
from probkv.models.dtypes import DEFAULT_DTYPE

#: The default ratios and weight temperatures of a run (``probkv attention-error``'s).
RATIOS = (0.25, 0.5, 0.75, 0.9)
TAUS = (1.0, 2.0, 5.0, 10.0, 50.0)


@dataclass(frozen=True)
class AttentionErrorRun:
    """The estimators measured (``ratios`` ... ``steps``, as ``measure_attention_error`` takes
    them) and the prompt: ``prompt_file`` (UTF-8 text), ``prompt_tokens`` (a prose haystack of
    about that many tokens around the Appendix E text) or neither (the Appendix E text);
    ``question`` (default the Appendix E question), ``format`` (``paper`` | ``chat``; default
    ``paper`` for the Appendix E prompt, else ``chat``)."""

    model: str
    out: str | Path
    ratios: Sequence[float] = RATIOS
    taus: Sequence[float] = TAUS
    seeds: int = 3
    proposal: str = "h2o"
    weights: str | None = None
    sampler: str = "with_replacement"
    scope: str = "head"
    steps: int = 0
    prompt_file: Path | None = None
    prompt_tokens: int | None = None
    question: str | None = None
    format: str | None = None
    dtype: str = DEFAULT_DTYPE

    def estimators(self) -> dict:
        """The keyword arguments of ``validate_arguments`` and ``measure_attention_error``."""
        return {
            "ratios": self.ratios,
            "taus": self.taus,
            "seeds": self.seeds,
            "proposal": self.proposal,
            "weights": self.weights,
            "sampler": self.sampler,
            "scope": self.scope,
            "steps": self.steps,
        }


@dataclass(frozen=True)
class AttentionErrorResult:
    rows: list[dict]
    path: Path


def run_attention_error(
    run: AttentionErrorRun, *, log: Callable[[str], None] = lambda message: None
) -> AttentionErrorResult:
    """Load the model, build the prompt and decode tokens, measure, write the JSON."""
    from probkv.hf import prepare_model  # transformers: only when a run starts
    from probkv.models import load_model, load_tokenizer, model_max_positions
    from probkv.models.dtypes import MODEL_DTYPES, resolve_dtype_name

    estimators = run.estimators()
    _, _, weights = ae.validate_arguments(**estimators)
    # Everything the user gave is checked before the model loads: a run that can only fail
    # at its end (an unwritable --out, a prompt past the model's positions) costs nothing.
    out = check_output_file(run.out, "--out")
    question = PAPER_QUESTION if run.question is None else run.question
    if not question.strip():
        raise ValueError("--question is empty; give a question or omit --question")
    text = None if run.prompt_file is None else read_prompt_file(run.prompt_file)
    start = time.perf_counter()
    limit = model_max_positions(run.model)
    if run.prompt_tokens is not None:  # refused before a haystack is even built
        check_positions("--prompt-tokens", run.prompt_tokens, run.steps, limit)
    tokenizer = load_tokenizer(run.model)
    prompt = build_prompt(run, tokenizer, text, question)
    check_positions("the prompt", len(prompt.context_ids), run.steps, limit)
    dtype = resolve_dtype_name(run.dtype)
    model, tokenizer = load_model(run.model, dtype=MODEL_DTYPES[dtype])
    prepare_model(model)
    decode = ae.decode_tokens(model, prompt, max(run.steps, 1))
    log(f"prompt: {len(prompt.context_ids)} tokens ({prompt.source}, {prompt.format} format)")
    log(f"model dtype: {dtype} (--dtype {run.dtype})")
    rows = ae.measure_attention_error(model, prompt.context_ids, decode, **estimators, progress=log)
    arguments = {
        **estimators,
        "weights": weights,
        "prompt_file": None if run.prompt_file is None else str(run.prompt_file),
        "prompt_tokens": run.prompt_tokens,
        "question": question,
        "dtype": dtype,
    }
    header = ae.results_header(
        model_name=run.model,
        prompt=prompt,
        decode_ids=decode,
        tokenizer=tokenizer,
        arguments=arguments,
        num_heads=rows[0]["num_heads"],
    )
    header["dtype"] = dtype
    header["runtime_s"] = round(time.perf_counter() - start, 2)
    write_json(out, {"header": header, "rows": rows})
    return AttentionErrorResult(rows, out)


def build_prompt(run: AttentionErrorRun, tokenizer, text: str | None, question: str):
    """The measured prompt: the prompt file's ``text``, a ``prompt_tokens`` haystack, or the
    paper's Appendix E text (tokenizer only: built before the model loads)."""
    if text is not None:
        return ae.text_prompt(tokenizer, text, question, format=run.format or "chat", source="file")
    if run.prompt_tokens is not None:
        return ae.haystack_prompt(
            tokenizer, run.prompt_tokens, format=run.format or "chat", question=question
        )
    return ae.text_prompt(
        tokenizer, PAPER_TEXT, question, format=run.format or "paper", source="paper"
    )


def check_positions(what: str, prompt_tokens: int, steps: int, limit: int) -> None:
    """Refuse a prompt that, with the ``max(steps, 1)`` decode tokens measured after it,
    needs more than the model's ``limit`` positions (ValueError naming ``what``)."""
    need = prompt_tokens + max(steps, 1)
    if need > limit:
        raise ValueError(
            f"{what} ({prompt_tokens} tokens) plus {max(steps, 1)} decode token(s) (--steps) "
            f"need {need} positions, above the model's limit of {limit} "
            "(max_position_embeddings); use a shorter prompt"
        )


def read_prompt_file(path: Path) -> str:
    """The text of ``--prompt-file``: UTF-8 and not blank, else a ValueError naming the flag."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"--prompt-file {str(path)!r}: cannot read it ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--prompt-file {str(path)!r}: not valid UTF-8 (byte 0x{data[err.start]:02x} at "
            f"offset {err.start}); give a UTF-8 text file"
        ) from None
    if not text.strip():
        raise ValueError(f"--prompt-file {str(path)!r} is empty; give a file with the prompt text")
    return text
