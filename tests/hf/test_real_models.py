"""The integration on the real models: SmolLM2 (default) and Gemma-3 (sliding + global layers).

Slow: each test loads a converted model from the cache (seconds) and runs a short prompt.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from probkv.hf import ProbKVCache, answer, compress, prepare_model
from probkv.models import chat_prompt_ids
from probkv.policies import parse_method

pytestmark = pytest.mark.slow

STORY = (
    "Mira kept a small notebook of the birds she saw near the river. On Monday she saw two "
    "herons and a kingfisher; on Tuesday, only ducks. Her brother Tomas counted boats instead, "
    "and he said the red ferry passed eleven times that week. "
)


@pytest.fixture
def sdpa_after(request):
    """Put the shared session model back on SDPA after a test switched it to probkv."""
    models = []
    yield models.append
    for model in models:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("method", ["prob:min-h", "prob:h2o/scope=global", "snapkv", "ada_snapkv"])
def test_smollm2_ratio_zero_generates_the_full_cache_tokens(smollm2, method, sdpa_after):
    model, tokenizer = smollm2
    sdpa_after(model)
    ids = chat_prompt_ids(tokenizer, STORY + "How many times did the red ferry pass?")
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=16, do_sample=False)
        prepare_model(model)
        cache = ProbKVCache(model.config, parse_method(method, ratio=0.0))
        got = model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache)
    assert torch.equal(got, reference), tokenizer.decode(got[0, ids.shape[1] :])


def test_smollm2_answers_two_questions_from_one_compressed_context(smollm2, sdpa_after):
    model, tokenizer = smollm2
    sdpa_after(model)
    prepare_model(model)
    ids = chat_prompt_ids(
        tokenizer, STORY * 3 + "Answer in one short sentence. How many herons did Mira see?"
    )
    split = ids.shape[1] - 12  # the last tokens (question and assistant header) come after
    context, question = ids[:, :split], ids[:, split:]
    compressed = compress(model, context, parse_method("prob:min-h", ratio=0.5))
    assert 0.4 < compressed.effective_ratio() < 0.6
    first = answer(model, compressed, question, max_new_tokens=12)
    again = answer(model, compressed, question, max_new_tokens=12)
    assert torch.equal(first, again)  # the first answer left no trace in the compressed state
    assert len(tokenizer.decode(first, skip_special_tokens=True).strip()) > 0


def test_gemma3_evicts_only_global_layers_and_matches_at_ratio_zero(gemma3, sdpa_after):
    model, tokenizer = gemma3
    sdpa_after(model)
    ids = tokenizer(STORY * 4, return_tensors="pt")["input_ids"]
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=8, do_sample=False)
        prepare_model(model)
        cache = ProbKVCache(model.config, parse_method("prob:min-h", ratio=0.0))
        got = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
    assert torch.equal(got, reference)

    layer_types = model.config.layer_types
    cache = compress(model, ids, parse_method("prob:min-h", ratio=0.5))
    full = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model(input_ids=ids, cache=full, use_cache=True)
    for i, kind in enumerate(layer_types):
        if kind == "sliding_attention":  # kept as transformers keeps it (float32 rounding aside:
            # earlier global layers' prefill went through probkv's chunked kernel)
            torch.testing.assert_close(
                cache.layers[i].keys, full.layers[i].keys, rtol=1e-4, atol=1e-4
            )
        else:
            assert i in cache.evicting_layers
            assert cache.layers[i].physical_length() < ids.shape[1]


def test_readme_examples_run(smollm2, capsys):
    """The README's three examples (its "Examples" section's python blocks, one after the
    other in one namespace), run as written."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Examples", 1)[1].split("\n## ", 1)[0]
    section = section.split("### Serve with vLLM", 1)[0]  # needs vLLM: tests/vllm run it
    blocks = [part.split("```", 1)[0] for part in section.split("```python\n")[1:]]
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert 0.4 < namespace["cache"].effective_ratio() < 0.6
    assert namespace["tokens"].numel() > 0
    # the decode budget with a pps design: at most B + K = 272 entries per KV head
    budgeted = namespace["budgeted"]
    assert budgeted.layers[budgeted.evicting_layers[0]].decode_state.stages >= 2
    assert max(budgeted.layers[i].physical_length() for i in budgeted.evicting_layers) <= 272
    assert (
        max(budgeted.layers[i].decode_state.peak_entries for i in budgeted.evicting_layers) <= 272
    )
    assert "4172" in capsys.readouterr().out  # the evicted prompt's answer
