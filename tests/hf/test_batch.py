"""Batches of prompts of different lengths, left-padded (S11 batches; ``probkv.hf``).

Each sequence of a batch is scored and evicted on its own: per sequence, the greedy tokens,
the kept entries and their log-weights equal that prompt's alone, whichever family of methods
(top-k, ``prob:`` per head and global, Ada-KV, reconstruction scores); the bytes a batch holds are the sum of its
sequences' alone; what is not batched is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from probkv.hf import (
    ProbKVCache,
    RepeatPrompt,
    answer,
    compress,
    pad_left,
    prepare_model,
    repeat_prompt,
)
from probkv.hf import attention as attention_module
from probkv.models.testing import TINY_EOS_ID, tiny_model
from probkv.policies import parse_method

torch.set_num_threads(1)

LENGTHS = (40, 25, 33)
METHODS = [
    "snapkv",
    "ada_snapkv",
    "prob:snapkv",
    "prob:min-h/scope=global",
    "prob:h2o/sampler=pps",
    "prob:snapkv/scope=global",
]
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    return prepare_model(tiny_model(request.param, seed=0))


def prompts(vocab: int, lengths=LENGTHS, seed: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def until_eos(tokens: torch.Tensor) -> list[int]:
    out = []
    for t in tokens.tolist():
        out.append(t)
        if t == TINY_EOS_ID:
            break
    return out


def assert_same_prefix(alone: ProbKVCache, batch: ProbKVCache, b: int) -> None:
    """Sequence ``b`` of ``batch`` keeps, in every evicting layer and KV head, exactly the
    keys, values and log-weights ``alone`` keeps."""
    for i in alone.evicting_layers:
        one, many = alone.layers[i], batch.layers[i]
        h = one.num_heads
        assert many.prefix.lengths[b * h : (b + 1) * h] == one.prefix.lengths
        for head in range(h):
            k1, v1, w1 = one.prefix.head(head)
            k2, v2, w2 = many.prefix.head(b * h + head)
            torch.testing.assert_close(k2, k1, rtol=0, atol=1e-5)
            torch.testing.assert_close(v2, v1, rtol=0, atol=1e-5)
            assert (w1 is None) == (w2 is None)
            if w1 is not None:
                torch.testing.assert_close(w2, w1, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("known_length", [True, False])
def test_a_batch_evicts_and_generates_each_sequence_as_alone(tiny, method, known_length):
    policy = parse_method(method, ratio=0.5)
    seqs = prompts(tiny.config.vocab_size)
    ids, mask = pad_left(seqs)
    t = ids.shape[1]
    cache = ProbKVCache(tiny.config, policy, prompt_length=t if known_length else None)
    with torch.no_grad():
        out = tiny.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    assert cache.batch_size == len(seqs)
    total = 0
    for b, seq in enumerate(seqs):
        alone = ProbKVCache(
            tiny.config, policy, prompt_length=seq.numel() if known_length else None
        )
        with torch.no_grad():
            one = tiny.generate(
                input_ids=seq[None], cache=alone, max_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert until_eos(out[b, t:]) == until_eos(one[0, seq.numel() :])
        assert_same_prefix(alone, cache, b)
        assert [r.kept_per_head for r in cache.reports(sequence=b)] == [
            r.kept_per_head for r in alone.reports()
        ]
        assert [r.prefix_length for r in cache.reports(sequence=b)] == [seq.numel()] * len(
            alone.reports()
        )
        assert cache.effective_ratio(sequence=b) == pytest.approx(alone.effective_ratio())
        assert cache.nbytes(sequence=b) == pytest.approx(alone.nbytes(), rel=0.01)
        total += alone.nbytes()
    assert cache.nbytes() == pytest.approx(total, rel=0.01)
    assert cache.token_ids.shape == (len(seqs), t + NEW_TOKENS - 1)


def test_ragged_segments_batched_op_equals_the_loop(monkeypatch):
    """The segment softmax over the flattened (sequence, head) layout (the path other devices
    take) gives what the per-segment loop gives (the CPU path)."""
    model = prepare_model(tiny_model("llama", seed=0))
    seqs = prompts(model.config.vocab_size)
    policy = parse_method("prob:min-h", ratio=0.5)
    results = []
    for batched in (False, True):
        monkeypatch.setattr(attention_module, "RAGGED_BATCHED_ON_CPU", batched)
        cache = compress(model, seqs, policy)
        assert not cache.layers[0].prefix.uniform_length
        ids, mask = pad_left([torch.tensor([5, 6, 7])] * len(seqs))
        full = torch.cat([cache.token_ids, ids], dim=1)
        full_mask = torch.cat([cache.attention_mask, mask], dim=1)
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                attention_mask=full_mask,
                position_ids=(full_mask.cumsum(-1) - 1)[:, -3:],
                cache=cache,
            ).logits
        results.append(logits)
        assert full.shape[1] == cache.get_seq_length()
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_equal_lengths_take_the_uniform_path(tiny):
    """Prompts of one length (no padding, no attention mask): top-k keeps the same number per
    segment, so decode is one batched matmul; each sequence still equals its own alone."""
    seqs = prompts(tiny.config.vocab_size, lengths=(30, 30))
    policy = parse_method("snapkv", ratio=0.5)
    cache = compress(tiny, torch.stack(seqs), policy)
    assert cache.attention_mask is None
    layer = cache.layers[cache.evicting_layers[0]]
    assert layer.prefix.uniform_length
    questions = torch.tensor([[7, 8, 9], [10, 11, 12]])
    out = answer(tiny, cache, questions, max_new_tokens=4)
    for b, seq in enumerate(seqs):
        alone = compress(tiny, seq, policy)
        assert_same_prefix(alone, cache, b)
        assert out[b].tolist() == answer(tiny, alone, questions[b], max_new_tokens=4).tolist()


@pytest.mark.parametrize("method", ["snapkv", "prob:min-h/scope=global"])
def test_compress_and_answer_a_batch_of_contexts_and_questions(method):
    """Question-agnostic: contexts compressed together, then questions of different lengths
    (padded on the left, so the padding sits after each context) answered together; twice
    from the same compressed state."""
    model = prepare_model(tiny_model("llama", seed=0))
    vocab = model.config.vocab_size
    contexts = prompts(vocab)
    questions = prompts(vocab, lengths=(3, 7, 5), seed=3)
    policy = parse_method(method, ratio=0.5)
    cache = compress(model, contexts, policy)
    first = answer(model, cache, questions, max_new_tokens=NEW_TOKENS)
    again = answer(model, cache, questions, max_new_tokens=NEW_TOKENS)
    assert torch.equal(first, again)
    for b, (context, question) in enumerate(zip(contexts, questions)):
        alone = compress(model, context, policy)
        expected = answer(model, alone, question, max_new_tokens=NEW_TOKENS)
        assert until_eos(first[b]) == until_eos(expected)


def test_padding_after_the_prompt_is_refused_with_sliding_window_layers():
    model = prepare_model(tiny_model("gemma3", seed=0))
    vocab = model.config.vocab_size
    cache = compress(model, prompts(vocab), parse_method("snapkv", ratio=0.5))
    with pytest.raises(ValueError, match="sliding-window layers"):
        answer(model, cache, prompts(vocab, lengths=(3, 7, 5), seed=3), max_new_tokens=2)


def test_what_is_not_batched_is_refused_by_name():
    model = prepare_model(tiny_model("llama", seed=0))
    seqs = prompts(model.config.vocab_size)
    ids, mask = pad_left(seqs)
    right = mask.flip(1)
    with pytest.raises(ValueError, match="left"):
        compress(model, ids, parse_method("snapkv", ratio=0.5), attention_mask=right)
    cache = compress(model, seqs, parse_method("snapkv", ratio=0.5))
    with pytest.raises(ValueError, match="sequence=i"):
        cache.reports()
    with pytest.raises(ValueError, match=r"sequences 0\.\.2"):
        cache.nbytes(sequence=3)
    with pytest.raises(ValueError, match="observations"):
        _ = cache.layers[0].observation
    with pytest.raises(ValueError, match="3 sequence"):
        answer(model, cache, seqs[:2], max_new_tokens=2)
    with pytest.raises(ValueError, match="beam search"):
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=ProbKVCache(model.config, parse_method("snapkv", ratio=0.5)),
            num_beams=2,
            max_new_tokens=2,
        )


# -- reconstruction scores (S10.1): each sequence's pass rows on their own ----------------------
# Token ids of the repeat prompt's parts; the opening is 3 context ids.
REPEAT = RepeatPrompt(first=(7, 8, 9), later=(10, 11), suffix=(12, 13), template_prefix=(5, 6, 20))
BATCH_METHODS = ["kvzip", "prob:kvzip", "ada_kvzip", "topk:kvzip-plus", "prob:h2o-rec"]


@pytest.mark.parametrize("method", BATCH_METHODS)
def test_a_batch_is_reconstructed_and_evicted_each_sequence_as_alone(tiny, method):
    """Contexts of different lengths (one without the template's opening), each read in a
    different number of chunks: per sequence the same kept entries, log-weights and answer as
    that context alone; the pass leaves the batch's cache as it was."""
    model = tiny
    contexts = prompts(model.config.vocab_size, lengths=(37, 22, 29))
    for context in contexts[::2]:
        context[:3] = torch.tensor(REPEAT.template_prefix)  # the opening is not reconstructed
    policy = parse_method(f"{method}/chunk_tokens=10", ratio=0.5)
    batch = compress(model, contexts, policy, repeat_prompt=REPEAT)
    questions = [torch.tensor([31, 32, 33]), torch.tensor([34, 35, 36]), torch.tensor([37, 38, 39])]
    answers = answer(model, batch, questions, max_new_tokens=4)
    for b, context in enumerate(contexts):
        alone = compress(model, context[None], policy, repeat_prompt=REPEAT)
        assert_same_prefix(alone, batch, b)
        assert batch.effective_ratio(sequence=b) == pytest.approx(alone.effective_ratio())
        expected = answer(model, alone, questions[b][None], max_new_tokens=4)
        assert until_eos(answers[b]) == until_eos(expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method", ["snapkv", "prob:snapkv", "prob:min-h/scope=global", "kvzip/chunk_tokens=64"]
)
def test_smollm2_batch_equals_alone(smollm2, method):
    """The real model: per sequence, the same greedy tokens and kept entries as alone."""
    model, tokenizer = smollm2
    prepare_model(model)
    from probkv.experiments.long_decode import prose_text

    ids = tokenizer(prose_text(400, seed=1), return_tensors="pt").input_ids[0]
    seqs = [ids[:160], ids[40:150], ids[80:210]]
    policy = parse_method(method, ratio=0.5)
    rec = {"repeat_prompt": repeat_prompt(tokenizer)} if method.startswith("kvzip") else {}
    cache = compress(model, seqs, policy, **rec)
    held = cache.nbytes()  # before answering: answer leaves a tail buffer allocated
    question = [torch.tensor([13]), torch.tensor([13]), torch.tensor([13])]
    out = answer(model, cache, question, max_new_tokens=8)
    total = 0
    for b, seq in enumerate(seqs):
        alone = compress(model, seq, policy, **rec)
        total += alone.nbytes()
        assert_same_prefix(alone, cache, b)
        expected = answer(model, alone, question[b], max_new_tokens=8).tolist()
        assert out[b, : len(expected)].tolist() == expected
    assert held == pytest.approx(total, rel=0.01)
