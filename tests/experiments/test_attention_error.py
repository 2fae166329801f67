"""The attention-error experiment (probkv.experiments.attention_error, S7, S9; paper Eq. 11)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import probkv.hf.eviction as eviction_module
from probkv import estimation
from probkv.cli.args import float_list
from probkv.cli.experiment_commands import format_table
from probkv.experiments import attention_error as ae
from probkv.experiments.paper_prompt import PAPER_QUESTION, PAPER_TEXT
from probkv.hf import LayerCapture, capture_attention, compress, observe, prepare_model
from probkv.models.testing import save_tiny_model_folder, tiny_model, tiny_tokenizer
from probkv.policies import ProbabilisticPolicy, TopKPolicy, parse_method

torch.set_num_threads(1)

T = 40  # prompt length of the tiny-model tests


@pytest.fixture(scope="module")
def llama():
    return prepare_model(tiny_model("llama"))  # the capture records probkv's attention


@pytest.fixture(scope="module")
def gemma3():
    return prepare_model(tiny_model("gemma3"))


def token_ids(n: int, seed: int) -> list[int]:
    """Random byte tokens of the tiny vocabulary (ids 6..261)."""
    return torch.randint(6, 262, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONTEXT = token_ids(T, 0)
DECODE = token_ids(4, 1)


def dense_causal_attention(capture: LayerCapture) -> torch.Tensor:
    """Slow reference: float64 causal softmax attention of every captured query row over the
    captured keys (GQA: query head h uses KV head h // g). -> [Hq, q, d_v]."""
    q, k, v = capture.query.double(), capture.key.double(), capture.value.double()
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    n, rows = k.shape[1], q.shape[1]
    logits = capture.scale * q @ k.transpose(1, 2)
    positions = torch.arange(rows).unsqueeze(1) + (n - rows)
    logits = logits.masked_fill(torch.arange(n).unsqueeze(0) > positions, -math.inf)
    return torch.softmax(logits, -1) @ v


# ------------------------------------------------------------------------------------ capture


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_captured_outputs_are_the_attention_of_the_captured_tensors(arch, request):
    """The capture run records the model's own attention: recomputing each evicted layer's
    causal attention from the captured post-RoPE q/k/v gives the captured outputs."""
    model = request.getfixturevalue(arch)
    captures = capture_attention(model, CONTEXT + DECODE)
    assert [c.layer_idx for c in captures] == list(range(model.config.num_hidden_layers))
    layers = ae.evicting_layers(model)
    assert layers == ([0, 1] if arch == "llama" else [1, 3])
    for i in layers:
        c = captures[i]
        assert c.query.shape == (4, T + 4, 16) and c.key.shape == (2, T + 4, 16)
        torch.testing.assert_close(
            c.output.double(), dense_causal_attention(c), atol=1e-5, rtol=1e-5
        )


def test_capture_leaves_the_forward_unchanged(llama):
    """Same logits with and without capture, and the model's implementation is restored."""
    ids = torch.tensor([CONTEXT])
    before = llama.config._attn_implementation
    expected = llama(input_ids=ids, use_cache=False).logits
    capture_attention(llama, CONTEXT)
    assert llama.config._attn_implementation == before
    assert torch.equal(llama(input_ids=ids, use_cache=False).logits, expected)


def test_capture_wraps_the_evicting_cache(llama):
    """With a ProbKVCache the capture wraps probkv's own attention: a captured decode step
    leaves the compressed cache exactly as a plain step does (same logits at the next step),
    and records only outputs when asked."""
    prepare_model(llama)
    policy = ProbabilisticPolicy(score="h2o", ratio=0.5, seed=3)
    plain = compress(llama, torch.tensor(CONTEXT), policy)
    llama(input_ids=torch.tensor([DECODE[:1]]), cache=plain, use_cache=True)
    cache = compress(llama, torch.tensor(CONTEXT), policy)
    captures = capture_attention(llama, DECODE[:1], cache=cache, keep_tensors=False)
    assert all(c.query is None and c.output.shape == (4, 1, 16) for c in captures)
    assert cache.get_seq_length() == plain.get_seq_length() == T + 1
    step = torch.tensor([DECODE[1:2]])
    expected = llama(input_ids=step, cache=plain, use_cache=True).logits
    assert torch.equal(llama(input_ids=step, cache=cache, use_cache=True).logits, expected)


def test_capture_refuses_an_unregistered_implementation():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="'eager'"):
        capture_attention(model, CONTEXT)


# ------------------------------------------------------------------ per-layer decode output


def test_decode_output_matches_algorithm_1_literally(llama):
    """Fast path (one softmax, -inf for evicted) vs the paper's Algorithm 1 written out
    (two normalisers, float64) for every query head, with a sampled weighted kept set."""
    captures = capture_attention(llama, CONTEXT + DECODE)
    obs = [ae.observe(c, score="min-h", length=T, rank=r) for r, c in enumerate(captures)]
    policy = ProbabilisticPolicy(score="min-h", ratio=0.6, seed=1)  # pps: 1 / P weights
    for c, selection in zip(captures, ae.select(policy, obs)):
        position = T + 2  # third decode token: sees d_1..d_3 unweighted
        fast = ae.decode_output(c, ae.prefix_log_weights(selection, T), position)
        g = c.query.shape[0] // c.key.shape[0]
        for h in range(c.query.shape[0]):
            idx, lw = selection.head(h // g)
            slow = estimation.corrected_attention_reference(
                c.query[h, position],
                c.key[h // g, idx],
                c.value[h // g, idx],
                lw,
                c.key[h // g, T : position + 1],
                c.value[h // g, T : position + 1],
                scale=c.scale,
            )
            torch.testing.assert_close(fast[h].double(), slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "policy",
    [
        TopKPolicy(score="h2o", ratio=0.5),
        ProbabilisticPolicy(score="min-h", ratio=0.5, seed=2),  # pps (1 / P weights)
        ProbabilisticPolicy(score="h2o", ratio=0.7, sampler="pps", tau=2.0, seed=5),
    ],
    ids=["topk", "counts", "pps"],
)
def test_step_one_of_the_lowest_layer_is_what_the_integration_computes(llama, policy):
    """The lowest evicted layer sees the full model's inputs in both measurements, so the
    per-layer step-1 output (selection from captured tensors, S3/S4) must equal the real
    integration's (compress, then the first decode token): same kept set, weights, output."""
    prepare_model(llama)
    captures = capture_attention(llama, CONTEXT + DECODE[:1])
    first = captures[0]
    obs = ae.observe(first, score=policy.score, length=T, rank=0)
    (selection,) = ae.select(policy, [obs])
    ours = ae.decode_output(first, ae.prefix_log_weights(selection, T), T)
    cache = compress(llama, torch.tensor(CONTEXT), policy)
    theirs = capture_attention(llama, DECODE[:1], cache=cache, keep_tensors=False)[0]
    torch.testing.assert_close(ours, theirs.output[:, 0].float(), atol=1e-5, rtol=1e-5)
    assert cache.reports()[0].kept_per_head == selection.lengths.tolist()


# ------------------------------------------------------------- one eviction path for both


SHARED_PATH_METHODS = [
    "prob:min-h/sampler=with_replacement/weights=counts/seed=3",  # sampled, with replacement
    "prob:snapkv/window=8/seed=1",  # sampled (pps), forced window
    "snapkv/window=8",  # top-k
    "ada_pyramidkv/window=8",  # top-k, layer and head budgets
    "prob:h2o/scope=global/sampler=with_replacement/seed=2",  # global scope (all layers at once)
    "prob:h2o-h/scope=global/seed=4",  # global pps
]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("method", SHARED_PATH_METHODS)
def test_the_experiment_keeps_what_the_integration_keeps(arch, method, request, monkeypatch):
    """The attention-error experiment (``ae.observe`` + ``ae.select``, what step 1 uses) and
    ``probkv eval``'s integration path (``probkv.hf.compress``, and ``observe`` + ``evict``)
    go through one eviction path (``observe_layer``, ``select_layers``): the same model,
    prompt and seed keep the same entries with the same weights in every evicted layer."""
    model = request.getfixturevalue(arch)
    policy = parse_method(method, ratio=0.5)
    applied: dict[int, object] = {}
    original = eviction_module.apply_selection

    def recording(layer, selections, *args):
        applied[layer.layer_idx] = selections[0]
        original(layer, selections, *args)

    monkeypatch.setattr(eviction_module, "apply_selection", recording)
    compress(model, torch.tensor(CONTEXT), policy)
    by_compress = dict(applied)
    applied.clear()
    observed = observe(model, torch.tensor(CONTEXT), policy.score, policy.score_params)
    copy.deepcopy(observed).evict(policy)
    by_observe = dict(applied)

    captures = capture_attention(model, CONTEXT + DECODE)
    layers = ae.evicting_layers(model)
    observations = [
        ae.observe(
            captures[i], score=policy.score, length=T, rank=r, score_params=policy.score_params
        )
        for r, i in enumerate(layers)
    ]
    ours = dict(zip(layers, ae.select(policy, observations), strict=True))
    assert set(ours) == set(by_compress) == set(by_observe) == set(layers)
    for i in layers:
        for theirs in (by_compress[i], by_observe[i]):
            assert torch.equal(ours[i].lengths, theirs.lengths)
            assert torch.equal(ours[i].indices, theirs.indices)
            assert (ours[i].log_weights is None) == (theirs.log_weights is None)
            if theirs.log_weights is not None:  # float32 rounding of the two forwards
                torch.testing.assert_close(ours[i].log_weights, theirs.log_weights)


# ------------------------------------------------------------------------------ the results


def reference_first_step_mae(model, policy) -> float:
    """Slow reference of one step-1 number: per layer, per query head, Algorithm 1 literally
    (float64) for the estimate and plain softmax attention for ``o``; mean over all heads."""
    captures = [capture_attention(model, CONTEXT + DECODE[:1])[i] for i in [0, 1]]
    errors = []
    for rank, c in enumerate(captures):
        obs = ae.observe(c, score=policy.score, length=T, rank=rank)
        (selection,) = ae.select(policy, [obs])
        g = c.query.shape[0] // c.key.shape[0]
        for h in range(c.query.shape[0]):
            q, k, v = c.query[h, T].double(), c.key[h // g, : T + 1], c.value[h // g, : T + 1]
            full = torch.softmax(c.scale * k.double() @ q, -1) @ v.double()
            idx, lw = selection.head(h // g)
            lw = torch.zeros(idx.numel()) if lw is None else lw
            est = estimation.corrected_attention_reference(
                q, k[idx], v[idx], lw, k[T:], v[T:], scale=c.scale
            )
            errors.append(float((full - est).abs().mean()))
    return sum(errors) / len(errors)


def test_step_one_rows_match_the_slow_reference(llama):
    """mae_mean is the mean over seeds of the head-averaged error, mae_std the population
    std over seeds; recomputed here from the slow reference for seeds 0 and 1."""
    rows = ae.measure_attention_error(
        llama, CONTEXT, DECODE, ratios=[0.5], taus=[2.0], seeds=2, proposal="min-h"
    )
    by_name = {(r["estimator"], r["tau"]): r for r in rows}
    checks = {
        ("topk", None): [TopKPolicy(score="h2o", ratio=0.5)],
        ("topk_proposal", None): [TopKPolicy(score="min-h", ratio=0.5)],
        ("uncorrected", None): [
            ProbabilisticPolicy(
                score="min-h", ratio=0.5, sampler="with_replacement", correct=False, seed=s
            )
            for s in (0, 1)
        ],
        ("corrected", 2.0): [
            ProbabilisticPolicy(
                score="min-h",
                ratio=0.5,
                sampler="with_replacement",
                weights="counts",
                tau=2.0,
                seed=s,
            )
            for s in (0, 1)
        ],
    }
    for key, policies in checks.items():
        errors = [reference_first_step_mae(llama, p) for p in policies]
        mean = sum(errors) / len(errors)
        std = math.sqrt(sum((e - mean) ** 2 for e in errors) / len(errors))
        row = by_name[key]
        assert row["seeds"] == len(errors)
        assert row["mae_mean"] == pytest.approx(mean, rel=1e-4, abs=1e-6)
        assert row["mae_std"] == pytest.approx(std, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("sampler", ["with_replacement", "pps"])
def test_ratio_zero_has_zero_error_and_positive_ratios_positive_error(llama, sampler):
    """r = 0 keeps everything with weight 1 (S1): every estimator is exact at step 1 and
    within float32 rounding (probkv's kernel vs SDPA) after compounding. r > 0 evicts: the
    error is positive for every estimation."""
    rows = ae.measure_attention_error(
        llama, CONTEXT, DECODE, ratios=[0.0, 0.5], taus=[1.0, 5.0], seeds=2, steps=2,
        sampler=sampler, weights=None if sampler == "pps" else "inclusion",
    )  # fmt: skip
    assert len(rows) == 2 * 2 * 5
    for row in rows:
        if row["ratio"] == 0.0:
            assert row["effective_ratio"] == 0.0
            if row["step"] == 1:
                assert row["mae_mean"] == 0.0 and row["mae_std"] == 0.0
            else:
                assert row["mae_mean"] < 1e-5
        else:
            assert row["mae_mean"] > 1e-3
            # kept fraction per head is 1 - r in expectation (S3); sd ~0.04 over 4 heads
            assert 0.3 < row["effective_ratio"] < 0.7


def test_rows_have_the_documented_format(gemma3):
    rows = ae.measure_attention_error(
        gemma3, CONTEXT, DECODE, ratios=[0.25, 0.75], taus=[1, 2], seeds=3, steps=3,
        proposal="h2o-h", weights="counts",
    )  # fmt: skip
    json.dumps(rows, allow_nan=False)  # plain JSON, no NaN or infinity
    assert [(r["step"], r["ratio"], r["estimator"], r["tau"]) for r in rows] == [
        (step, ratio, name, tau)
        for step in (1, "1..3")
        for ratio in (0.25, 0.75)
        for name, tau in [
            ("topk", None),
            ("topk_proposal", None),
            ("uncorrected", None),
            ("corrected", 1.0),
            ("corrected", 2.0),
        ]
    ]
    for row in rows:
        assert tuple(row) == ae.ROW_FIELDS
        assert row["num_heads"] == 8  # Gemma-3: only the 2 global layers x 4 query heads
        deterministic = row["estimator"].startswith("topk")
        assert row["seeds"] == (1 if deterministic else 3)
        assert row["sampler"] == (None if deterministic else "with_replacement")
        assert row["weights"] == ("counts" if row["estimator"] == "corrected" else None)
        assert row["proposal"] == ("h2o" if row["estimator"] == "topk" else "h2o-h")
        if deterministic:
            assert row["mae_std"] == 0.0
            assert row["effective_ratio"] == pytest.approx(row["ratio"], abs=1 / T)
        else:
            assert row["mae_std"] > 0.0
    # uncorrected and corrected share the kept set at each seed: same effective ratio
    for step in (1, "1..3"):
        for ratio in (0.25, 0.75):
            sampled = {
                r["effective_ratio"]
                for r in rows
                if r["step"] == step and r["ratio"] == ratio and r["seeds"] == 3
            }
            assert len(sampled) == 1
    table = format_table(rows)
    assert "corrected tau=2" in table and "1..3" in table


def test_huge_tau_equals_uncorrected(llama):
    """tau -> inf removes the correction (S4): log w / 1e9 is ~1e-8, so the corrected error
    must equal the uncorrected one to float32 rounding, at step 1 and compounded."""
    rows = ae.measure_attention_error(
        llama, CONTEXT, DECODE, ratios=[0.6], taus=[1e9, 1.0], seeds=2, steps=2
    )
    for step in (1, "1..2"):
        at = {(r["estimator"], r["tau"]): r for r in rows if r["step"] == step}
        uncorrected, huge = at[("uncorrected", None)], at[("corrected", 1e9)]
        assert huge["mae_mean"] == pytest.approx(uncorrected["mae_mean"], rel=1e-5, abs=1e-7)
        assert huge["mae_std"] == pytest.approx(uncorrected["mae_std"], rel=1e-3, abs=1e-7)
        assert at[("corrected", 1.0)]["mae_mean"] != pytest.approx(huge["mae_mean"], rel=1e-3)


def test_global_scope_runs_and_moves_budgets_between_heads(llama):
    rows = ae.measure_attention_error(
        llama, CONTEXT, DECODE, ratios=[0.5], taus=[1], seeds=1, scope="global", steps=1
    )
    assert all(r["mae_mean"] > 0 for r in rows)
    assert len(rows) == 2 * 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratios": [1.0]}, "ratios"),
        ({"ratios": []}, "ratios must not be empty"),
        ({"taus": [math.inf]}, "taus must be finite"),
        ({"taus": [0.0]}, "taus"),
        ({"seeds": 0}, "seeds"),
        ({"steps": -1}, "steps"),
        ({"proposal": "oracle"}, "proposal"),
        ({"sampler": "pps", "weights": "counts"}, "pps always"),
        ({"weights": "pps"}, "weights"),
        ({"scope": "layer"}, "scope"),
        ({"steps": 5}, "steps=5 needs 5"),
    ],
)
def test_bad_arguments_are_refused_by_name(llama, kwargs, match):
    arguments = {"ratios": [0.5], "taus": [1.0], "seeds": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        ae.measure_attention_error(llama, CONTEXT, DECODE, **arguments)


# ------------------------------------------------------------------------------------ prompts


def test_paper_format_is_plain_text_and_the_question_first_token():
    tokenizer = tiny_tokenizer()
    prompt = ae.paper_prompt(tokenizer)
    assert list(prompt.context_ids) == tokenizer.encode(PAPER_TEXT)  # byte-level, no BOS
    assert tokenizer.decode(list(prompt.forced_ids)) == PAPER_QUESTION
    chat = ae.paper_prompt(tokenizer, format="chat")
    assert chat.forced_ids == ()
    text = tokenizer.decode(list(chat.context_ids))
    assert text.endswith(PAPER_QUESTION + "</s><|assistant|>") and PAPER_TEXT in text


def test_haystack_prompt_fits_the_length_and_contains_the_paper_text():
    tokenizer = tiny_tokenizer()
    for fmt in ("chat", "paper"):
        prompt = ae.haystack_prompt(tokenizer, 1500, format=fmt)
        # fitted word by word: at most N, and one word (< 20 bytes here) from it
        assert 1500 - 20 <= len(prompt.context_ids) <= 1500
        assert PAPER_TEXT in tokenizer.decode(list(prompt.context_ids))
    assert ae.haystack_prompt(tokenizer, 1500) == ae.haystack_prompt(tokenizer, 1500)
    with pytest.raises(ValueError, match="too small"):
        ae.haystack_prompt(tokenizer, 100)


def test_decode_tokens_are_the_forced_tokens_then_the_greedy_continuation(llama):
    prompt = ae.AttentionPrompt(tuple(CONTEXT), tuple(DECODE[:2]), "test", "paper")
    assert ae.decode_tokens(llama, prompt, 1) == tuple(DECODE[:1])
    tokens = ae.decode_tokens(llama, prompt, 6)
    assert tokens[:2] == tuple(DECODE[:2]) and len(tokens) == 6
    ids = torch.tensor([CONTEXT + DECODE[:2]])
    greedy = []
    for _ in range(4):  # greedy by hand, with the full model
        nxt = int(llama(input_ids=ids, use_cache=False).logits[0, -1].argmax())
        greedy.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert list(tokens[2:]) == greedy


# ---------------------------------------------------------------------------------------- CLI


def test_cli_is_wired_and_parses_lists():
    from probkv.cli import main as cli

    args = cli.build_parser().parse_args(["attention-error", "--out", "x.json"])
    assert args.ratios == [0.25, 0.5, 0.75, 0.9] and args.taus == [1, 2, 5, 10, 50]
    assert (args.seeds, args.proposal, args.weights, args.sampler, args.steps) == (
        3,
        "h2o",
        None,
        "with_replacement",
        0,
    )
    assert float_list("0.25, 0.5") == [0.25, 0.5]
    with pytest.raises(Exception, match="'x' in"):
        float_list("0.5,x")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(
            ["attention-error", "--out", "x", "--prompt-file", "f", "--prompt-tokens", "9"]
        )


def test_cli_end_to_end_on_a_tiny_model_folder(tmp_path, capsys):
    """The whole command on a saved tiny model: prompt file, chat format, compounded steps,
    the model in bfloat16 (recorded in the header)."""
    from probkv.cli import main as cli

    folder = save_tiny_model_folder(tmp_path / "tiny", "qwen2")
    text = tmp_path / "prompt.txt"
    text.write_text("The river is wide. " * 3, encoding="utf-8")
    out = tmp_path / "res" / "errors.json"
    status = cli.main(
        ["attention-error", "--model", str(folder), "--prompt-file", str(text), "--question",
         "What is wide?", "--ratios", "0,0.5", "--taus", "1", "--seeds", "2", "--steps", "2",
         "--out", str(out), "--dtype", "bfloat16"]
    )  # fmt: skip
    assert status == 0
    result = json.loads(out.read_text())
    assert result["header"]["dtype"] == result["header"]["arguments"]["dtype"] == "bfloat16"
    header, rows = result["header"], result["rows"]
    assert header["prompt"]["format"] == "chat" and header["prompt"]["source"] == "file"
    tokenizer = tiny_tokenizer()
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text.read_text() + "\n\nWhat is wide?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert header["prompt"]["prompt_tokens"] == len(tokenizer.encode(rendered))
    assert len(header["prompt"]["decode_ids"]) == 2
    assert header["arguments"]["weights"] == "counts" and header["num_heads"] == 8
    assert set(header["definitions"]) >= {"step 1", "step 1..N", "mae_std"}
    assert len(rows) == 2 * 2 * 4
    assert "wrote 16 rows" in capsys.readouterr().out
    # pps with explicit count weights is refused before any model is loaded
    bad = cli.main(
        ["attention-error", "--model", str(tmp_path / "missing"), "--sampler", "pps",
         "--weights", "counts", "--out", str(out)]
    )  # fmt: skip
    assert bad == 2 and "pps always" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_paper_prompt_is_157_tokens_for_smollm2(smollm2):
    """S9's measurement: the Appendix E text is 157 SmolLM2 tokens; d_1 is 'Who'."""
    _, tokenizer = smollm2
    prompt = ae.paper_prompt(tokenizer)
    assert len(prompt.context_ids) == 157
    assert tokenizer.decode(list(prompt.forced_ids[:1])) == "Who"


@pytest.mark.slow
def test_smollm2_paper_prompt_two_ratios(smollm2):
    """The experiment on SmolLM2 (1 seed, 2 ratios): all 270 heads, H2O's error grows with r."""
    model, tokenizer = smollm2
    prompt = ae.paper_prompt(tokenizer)
    decode = ae.decode_tokens(model, prompt, 1)
    rows = ae.measure_attention_error(
        model, prompt.context_ids, decode, ratios=[0.25, 0.75], taus=[1, 50], seeds=1,
        proposal="min-h", weights="inclusion",
    )  # fmt: skip
    assert len(rows) == 2 * 5 and all(r["num_heads"] == 270 for r in rows)
    topk = [r["mae_mean"] for r in rows if r["estimator"] == "topk"]
    assert 0 < topk[0] < topk[1]
    assert all(r["mae_mean"] > 0 for r in rows)
