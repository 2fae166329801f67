"""Batches held to a decode budget (S10.5 in S11 batches; ``probkv.hf.decode_budget``).

Per sequence of a left-padded batch of prompts of different lengths (one shorter than
``max_entries``, which reaches its stages at other steps), the greedy tokens, every decode
stage (the step it comes at, the entries it keeps, their log-weights) and the final kept
entries equal that prompt's alone; no head holds more than ``B + K`` entries; the bytes a
batch holds are the sum of its sequences' alone; what is not batched is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from probkv.hf import ProbKVCache, answer, compress, generate, pad_left, prepare_model
from probkv.hf import decode_budget as decode_budget_module
from probkv.models.testing import tiny_model
from probkv.policies import parse_method

torch.set_num_threads(1)

LENGTHS = (40, 9, 25)  # 9 < max_entries: kept whole, its first stage comes later
MAX_ENTRIES = 12
NEW_TOKENS = 20
METHODS = ["tova", "h2o", "snapkv", "prob:tova", "prob:h2o-h"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    return prepare_model(tiny_model(request.param, seed=0))


def prompts(vocab: int, lengths=LENGTHS, seed: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


@pytest.fixture
def stages(monkeypatch):
    """Every decode stage, recorded per layer object: ``{id(layer): (layer, [(tokens seen,
    stage, lengths, keys, log-weights, the stage's log-scores per group)])}`` (a batch's
    sequences are layers of their own; the layer is held, so that its id is not reused by a
    later one); ``take(layer)`` pops them."""
    seen: dict[int, tuple] = {}
    scores: dict[int, list] = {}
    done, start = decode_budget_module.stage_done, decode_budget_module.next_stage

    def starting(layer, scale):
        stage = start(layer, scale)
        scores[id(layer)] = [obs.log_scores.clone() for _, obs in stage.groups]
        return stage

    def recording(layer, selection):
        done(layer, selection)
        p = layer.prefix
        lw = None if p.log_weights is None else p.log_weights.clone()
        record = (layer.get_seq_length(), layer.decode_state.stages, list(p.lengths))
        record = (*record, p.keys.clone(), lw, scores.pop(id(layer)))
        seen.setdefault(id(layer), (layer, []))[1].append(record)

    def take(layer) -> list:
        return seen.pop(id(layer), (layer, []))[1]

    monkeypatch.setattr(decode_budget_module, "next_stage", starting)
    monkeypatch.setattr(decode_budget_module, "stage_done", recording)
    return take


def same_entries(one: tuple, many: tuple, tol: float) -> bool:
    """Two stage records keep the same entries (their keys: a wrong entry differs by O(1), the
    batched arithmetic by rounding)."""
    return one[3].shape == many[3].shape and torch.allclose(many[3], one[3], rtol=tol, atol=tol)


def assert_same_stages(one: list, many: list, tol: float = 1e-5) -> None:
    """The same stages at the same steps, keeping the same entries with the same log-weights."""
    assert [r[:3] for r in many] == [r[:3] for r in one]  # the same steps, stages, counts
    for (*_, k1, w1, _), (*_, k2, w2, _) in zip(one, many, strict=True):
        torch.testing.assert_close(k2, k1, rtol=tol, atol=tol)
        assert (w1 is None) == (w2 is None)
        if w1 is not None:
            torch.testing.assert_close(w2, w1, rtol=0, atol=tol)


def assert_first_difference_is_a_tie(records: list, keep: int) -> None:
    """``records``: ``[(layer, alone's stages, the batch's)]`` of one sequence. Where a batch's
    stage keeps other entries than alone's, the first such stage (by step, then layer) is a
    top-k stage whose ``keep``-th and next scores tie but for rounding (a batch's decode
    rounds its keys differently from one sequence's); what follows is its consequence."""
    first = None
    for layer, one, many in records:
        assert [r[:3] for r in many] == [r[:3] for r in one]
        for a, b in zip(one, many, strict=True):
            if not same_entries(a, b, 2e-4):
                first = min(first or (a[0], layer, a), (a[0], layer, a), key=lambda x: x[:2])
                break
    if first is None:
        return
    gaps = []
    for group in first[2][5]:
        top = group.double().topk(keep + 1, dim=-1).values
        gaps.append((top[:, keep - 1] - top[:, keep]).abs().min())
    assert min(gaps) < 1e-5


def assert_same_layers(alone: ProbKVCache, batch: ProbKVCache, b: int, extra: int = 0) -> None:
    """Sequence ``b`` of ``batch`` holds, in every evicting layer, what ``alone`` holds: kept
    entries and log-weights per head (its own and in the batch's joined prefix), the tail,
    stages and peaks, at most ``B + K`` entries per head (``+ extra``: a forward of ``q``
    tokens may hold ``q - 1`` more, S10.5)."""
    for i in alone.evicting_layers:
        one, layer = alone.layers[i], batch.layers[i]
        mine = layer.sequence_layers[b]
        h = one.num_heads
        assert mine.prefix.lengths == one.prefix.lengths
        assert layer.prefix.lengths[b * h : (b + 1) * h] == one.prefix.lengths
        for head in range(h):
            k1, v1, w1 = one.prefix.head(head)
            for k2, v2, w2 in (mine.prefix.head(head), layer.prefix.head(b * h + head)):
                torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5)
                if w1 is None:  # the joined prefix holds zeros if another sequence has weights
                    assert w2 is None or not bool(w2.any())
                else:
                    torch.testing.assert_close(w2, w1, rtol=0, atol=1e-5)
        assert (mine.prefix.log_weights is None) == (one.prefix.log_weights is None)
        torch.testing.assert_close(mine.tail_keys, one.tail_keys, rtol=0, atol=1e-5)
        assert mine.decode_state.stages == one.decode_state.stages
        assert mine.decode_state.peak_entries == one.decode_state.peak_entries
        assert mine.decode_state.peak_entries <= MAX_ENTRIES + one.decode_budget.every + extra
        assert mine.decode_state.peak_bytes == one.decode_state.peak_bytes


def greedy(model, cache, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``NEW_TOKENS`` greedy tokens from ``ids`` into ``cache`` (no end of text: every step
    runs, alone and in a batch)."""
    kw = {} if mask is None else {"attention_mask": mask, "pad_token_id": 0}
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            cache=cache,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            **kw,
        )


def run_alone(model, policy, seq: torch.Tensor, every: int) -> tuple[ProbKVCache, list]:
    cache = ProbKVCache(model.config, policy, max_entries=MAX_ENTRIES, every=every)
    out = greedy(model, cache, seq[None])
    return cache, out[0, seq.numel() :].tolist()


@pytest.mark.parametrize("every", [1, 4])
@pytest.mark.parametrize("method", METHODS)
def test_a_budgeted_batch_evicts_and_generates_each_sequence_as_alone(tiny, method, every, stages):
    policy = parse_method(method)
    seqs = prompts(tiny.config.vocab_size)
    ids, mask = pad_left(seqs)
    t = ids.shape[1]
    cache = ProbKVCache(tiny.config, policy, max_entries=MAX_ENTRIES, every=every)
    out = greedy(tiny, cache, ids, mask)
    assert cache.batch_size == len(seqs)
    assert cache.get_seq_length() == t + NEW_TOKENS - 1
    batch_stages = {b: {} for b in range(len(seqs))}
    for i in cache.evicting_layers:
        for b, mine in enumerate(cache.layers[i].sequence_layers):
            batch_stages[b][i] = stages(mine)
    total = 0
    peaks = {i: [] for i in cache.evicting_layers}
    for b, seq in enumerate(seqs):
        alone, tokens = run_alone(tiny, policy, seq, every)
        for i in alone.evicting_layers:
            peaks[i].append(alone.layers[i].decode_state)
        assert out[b, t:].tolist() == tokens
        for i in alone.evicting_layers:
            theirs = stages(alone.layers[i])
            assert len(theirs) >= 1  # decode stages ran
            assert_same_stages(theirs, batch_stages[b][i])
        assert_same_layers(alone, cache, b)  # peaks <= B + K
        mine, theirs = cache.reports(sequence=b), alone.reports()
        assert [(r.stage, r.kept_per_head, r.prefix_length) for r in mine] == [
            (r.stage, r.kept_per_head, r.prefix_length) for r in theirs
        ]
        assert [r.target_ratio for r in mine] == pytest.approx([r.target_ratio for r in theirs])
        assert cache.effective_ratio(sequence=b) == pytest.approx(alone.effective_ratio())
        assert cache.nbytes(sequence=b) == pytest.approx(alone.nbytes(), rel=0.01)
        total += alone.nbytes()
    assert cache.nbytes() == pytest.approx(total, rel=0.01)
    for i, states in peaks.items():  # the batch layer's: over its sequences, bytes summed
        state = cache.layers[i].decode_state
        assert state.stages == max(s.stages for s in states)
        assert state.peak_entries == max(s.peak_entries for s in states) <= MAX_ENTRIES + every
        assert state.peak_bytes <= 1.01 * sum(s.peak_bytes for s in states)
    # the short prompt reaches its first decode stage at another step than the long ones
    first = cache.evicting_layers[0]
    steps = [batch_stages[b][first][0][0] - n for b, n in enumerate(LENGTHS)]
    assert steps[1] > steps[0]


def test_compress_generate_and_answer_a_budgeted_batch():
    """The workflow: a batch of contexts compressed to a budget, then questions of one length
    (several tokens at once, no padding) answered together, twice from the same compressed
    state; each sequence as alone."""
    model = prepare_model(tiny_model("llama", seed=0))
    vocab = model.config.vocab_size
    contexts = prompts(vocab)
    questions = torch.stack(prompts(vocab, lengths=(3, 3, 3), seed=3))
    policy = parse_method("prob:h2o-h")
    cache = compress(model, contexts, policy, max_entries=MAX_ENTRIES, every=4)
    before = cache.nbytes()
    first = answer(model, cache, questions, max_new_tokens=12, min_new_tokens=12)
    assert torch.equal(answer(model, cache, questions, max_new_tokens=12, min_new_tokens=12), first)
    assert cache.nbytes() == before
    grown = generate(model, cache, questions, max_new_tokens=12, min_new_tokens=12)
    assert torch.equal(grown, first)
    for b, (context, question) in enumerate(zip(contexts, questions)):
        alone = compress(model, context, policy, max_entries=MAX_ENTRIES, every=4)
        expected = generate(model, alone, question, max_new_tokens=12, min_new_tokens=12)
        assert first[b].tolist() == expected.tolist()
        assert_same_layers(alone, cache, b, extra=questions.shape[1] - 1)


def test_padded_new_tokens_of_a_budgeted_batch_are_refused():
    """A padding token among a sequence's new tokens would be an entry of its stages, which
    alone it never has: refused by name, by generate and by a plain forward."""
    model = prepare_model(tiny_model("llama", seed=0))
    vocab = model.config.vocab_size
    contexts = prompts(vocab)
    cache = compress(model, contexts, parse_method("tova"), max_entries=MAX_ENTRIES, every=4)
    questions = prompts(vocab, lengths=(3, 7, 5), seed=3)
    with pytest.raises(ValueError, match=r"decode budget \(max_entries=12\).*padded"):
        answer(model, cache, questions, max_new_tokens=2)
    ids, mask = pad_left(questions)
    full_mask = torch.cat([cache.attention_mask, mask], dim=1)
    refused = pytest.raises(ValueError, match="decode budget takes new tokens without padding")
    with refused, torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=full_mask,
            position_ids=(full_mask.cumsum(-1) - 1)[:, -ids.shape[1] :],
            cache=cache.copy(),
        )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["tova", "prob:h2o-h", "topk:kvzap"])
def test_smollm2_budgeted_batch_equals_alone(smollm2, method, stages):
    """The real model: per sequence, the same greedy tokens, stages and kept entries as alone
    (``kvzap``, a score fixed per entry, with SmolLM2's shipped scorer)."""
    model, tokenizer = smollm2
    prepare_model(model)
    from probkv.experiments.long_decode import prose_text

    ids = tokenizer(prose_text(400, seed=1), return_tensors="pt").input_ids[0]
    seqs = [ids[:160], ids[40:70], ids[80:210]]  # 30 < max_entries=48
    policy = parse_method(method)
    budget = {"max_entries": 48, "every": 8}
    cache = compress(model, seqs, policy, **budget)
    question = torch.tensor([[13, 504]] * 3)
    out = generate(model, cache, question, max_new_tokens=32, min_new_tokens=32)
    total = 0
    for b, seq in enumerate(seqs):
        alone = compress(model, seq, policy, **budget)
        expected = generate(model, alone, question[b], max_new_tokens=32, min_new_tokens=32)
        assert out[b].tolist() == expected.tolist()
        records = []
        for i in alone.evicting_layers:
            mine = cache.layers[i].sequence_layers[b]
            records.append((i, stages(alone.layers[i]), stages(mine)))
            assert len(records[-1][1]) >= 1
            assert mine.decode_state.peak_entries <= 48 + 8
        if "kvzap" in method:
            # kvzap's scores of layer 0 tie on repeated tokens of this text (gaps of 0 to 5e-7
            # at the 48th), and rounding decides such a tie: a swapped entry, which later
            # layers and stages follow; the tokens stay equal
            assert_first_difference_is_a_tie(records, keep=48)
        else:
            for _, theirs, ours in records:  # float32 rounding through 30 layers: ~2e-5
                assert_same_stages(theirs, ours, 2e-4)
        assert cache.nbytes(sequence=b) == pytest.approx(alone.nbytes(), rel=0.01)
        total += alone.nbytes()
    assert cache.nbytes() == pytest.approx(total, rel=0.01)


@pytest.mark.parametrize("method", ["prob:h2o-h", "tova"])
def test_the_batched_ragged_op_serves_a_budgeted_batch(monkeypatch, method, stages):
    """The segment softmax over the flattened (sequence, head) layout (the path off the CPU)
    hands each sequence's statistics the probabilities they read alone: the same stages."""
    from probkv.hf import attention as attention_module

    monkeypatch.setattr(attention_module, "RAGGED_BATCHED_ON_CPU", True)
    calls = []
    batched = attention_module._ragged_batched

    def counted(prefix, qg, tail_logits, tail_v, scale, keep_probs):
        calls.append(keep_probs)
        return batched(prefix, qg, tail_logits, tail_v, scale, keep_probs)

    monkeypatch.setattr(attention_module, "_ragged_batched", counted)
    model = prepare_model(tiny_model("llama", seed=0))
    policy = parse_method(method)
    seqs = prompts(model.config.vocab_size)
    ids, mask = pad_left(seqs)
    cache = ProbKVCache(model.config, policy, max_entries=MAX_ENTRIES, every=4)
    out = greedy(model, cache, ids, mask)
    assert any(calls)  # the 9-token prompt makes the batch ragged, and a stage read its rows
    calls.clear()
    for b, seq in enumerate(seqs):
        alone, tokens = run_alone(model, policy, seq, 4)
        assert out[b, ids.shape[1] :].tolist() == tokens
        for i in alone.evicting_layers:
            theirs = stages(alone.layers[i])
            assert theirs
            assert_same_stages(theirs, stages(cache.layers[i].sequence_layers[b]))
        assert_same_layers(alone, cache, b)
