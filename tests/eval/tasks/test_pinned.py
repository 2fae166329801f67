"""Generated examples are pinned: the same task, tokenizer, length and seed give the same bytes
(``examples.jsonl`` of a run is checked against the generator on resume, so a change here
would refuse every older run). A deliberate change to a generator updates its hash here."""

from __future__ import annotations

import hashlib

import pytest

from probkv.eval.examples import write_examples
from probkv.eval.haystack import word_stream
from probkv.eval.tasks import TASK_NAMES, generate_examples
from probkv.models.testing import tiny_tokenizer

# sha256 of examples.jsonl (write_examples) of 2 examples per (tokenizer, length, seed):
# the byte-level tiny tokenizer at 1500 and 4200 tokens (cwe changes its repeats at 4096)
# and the word-level test tokenizer at 300 tokens, seeds 0 and 7.
PINNED = {
    "niah_single_1": "4fcd078f85d730a8e6aaef9635d95a9e7aed891e69cd35dee9f82dfbb7aaa379",
    "niah_single_2": "6f1ed82f387873f238a92343b9b4be46d3bed800c39ef6bacd0d8e1e50d35c66",
    "niah_single_3": "073d54418297b904e8f032a452daa410655c302e759f90cb5726419dce8f30f7",
    "niah_multikey_1": "5d40befdb808a109129585e3eca29f4a9d3139aca4a326335676e96e77e4ee60",
    "niah_multikey_2": "9905c23b531348c76128006e7c90947c2b7d06e58faac0da72fd362e1b3ac0da",
    "niah_multikey_3": "2220f7956109104b59646a7e281f60eba86aae4e7fec1baba44b528883d4f50f",
    "niah_multivalue": "7027d7636825d0d2f06a8437e942ca6f9b183d3cc92260b0423e54da84e9ae71",
    "niah_multiquery": "7654aafc8caeca494440b5b9a21977156b354e5694589d161331245ebd512b9f",
    "vt": "cd8eab679841125c5af7a0a63a15ee344d64884677f388f0f80ac6c6374972d7",
    "cwe": "f0e30b02b536753378985591f11128a4f0cd45c0e44115cc4f2b6b9d4c20405c",
    "fwe": "28d1221bd485228ed86907f856c7bb926ff670b81974665ea7e97f9c2887491b",
    "qa": "4b1f25aee5b253f705b95b39d4610368a5249e1c8fe2ba19b199c6d3f6672bbf",
}
PINNED_HAYSTACKS = {
    "noise": "192f453b27762580c1bfb279288f35b7ed6ca6b3d1010b979114b92907bf2ec1",
    "prose": "3f1ac07385f052fc90f8a40e3d550b02274bed3f34bc2899830ce6b1c46eba8a",
}


def examples_sha256(task, simple_tokenizer, tmp_path) -> str:
    digest = hashlib.sha256()
    settings = [(tiny_tokenizer(), n) for n in (1500, 4200)] + [(simple_tokenizer, 300)]
    for i, (tokenizer, length) in enumerate(settings):
        for seed in (0, 7):
            examples = generate_examples(
                task, tokenizer=tokenizer, length=length, num_examples=2, seed=seed
            )
            path = tmp_path / f"{task}-{i}-{seed}.jsonl"
            write_examples(path, examples)
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_every_task_is_pinned():
    assert set(PINNED) == set(TASK_NAMES)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_generated_examples_are_unchanged(task, simple_tokenizer, tmp_path):
    assert examples_sha256(task, simple_tokenizer, tmp_path) == PINNED[task]


@pytest.mark.parametrize("kind", sorted(PINNED_HAYSTACKS))
def test_haystack_text_is_unchanged(kind):
    stream = word_stream(kind, "pinned")
    text = stream.render(3000, [(0.0, "FIRST."), (0.37, "MIDDLE."), (1.0, "LAST.")])
    assert hashlib.sha256(text.encode()).hexdigest() == PINNED_HAYSTACKS[kind]
