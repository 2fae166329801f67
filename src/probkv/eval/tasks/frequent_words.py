"""RULER's frequent words extraction (S7): ``fwe``."""

from __future__ import annotations

import random
from dataclasses import dataclass

from probkv._checks import check_positive_int
from probkv.eval.haystack import prose_vocabulary
from probkv.eval.tasks.blocks import Builder, Draft, UniqueValues, occurs_in, pseudo_word


@dataclass(frozen=True)
class FrequentWordsTask:
    """RULER frequent words extraction: a text of made-up "coded" words whose frequencies
    follow a Zipf law ``p(k) ∝ k^-alpha`` over ``vocab_size`` words; name the ``num_top`` most
    frequent. Counts are ``round(n p(k))`` for a text of about ``n`` words, so the ranking is
    exact (the top words are strictly more frequent than the rest), then the words are shuffled."""

    name: str = "fwe"
    num_top: int = 3
    alpha: float = 2.0
    vocab_size: int = 200
    min_words: int = 40
    max_new_tokens: int = 32
    metric: str = "string_match_all"

    def __post_init__(self) -> None:
        check_positive_int(self.num_top, "num_top")
        check_positive_int(self.vocab_size, "vocab_size")
        check_positive_int(self.max_new_tokens, "max_new_tokens")
        if self.vocab_size <= self.num_top:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be > num_top ({self.num_top})")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")

    def builder(self, seed_key: str, position: float, length: int) -> Builder:
        rng = random.Random(seed_key)
        intro = (
            "The text below is written in a code of made-up words. Keep count of how often each "
            "coded word appears.\n\n"
        )
        question = (
            f"\n\nQuestion: Which {self.num_top} coded words appear most often in the text above? "
            "Reply with the words only."
        )
        prefix = f"Answer: The {self.num_top} most frequent coded words in the text above are:"
        in_prompt = occurs_in(intro + question + prefix)
        # Made-up words of equal length: none is a substring of another.
        vocab = UniqueValues(
            rng, lambda r: pseudo_word(r, 2), set(prose_vocabulary()), in_prompt
        ).take(self.vocab_size)
        weights = [(k + 1) ** -self.alpha for k in range(self.vocab_size)]
        total = sum(weights)
        probs = [w / total for w in weights]
        top = tuple(vocab[: self.num_top])

        def build(units: int, fill: int) -> Draft:
            n = units + self.min_words
            counts = [round(n * p) for p in probs]
            if counts[self.num_top - 1] <= counts[self.num_top]:
                raise ValueError(f"fwe: {n} words are too few to rank the top {self.num_top}")
            words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
            random.Random(f"{seed_key}:order:{units}").shuffle(words)
            metadata = {"alpha": self.alpha, "counts": counts[: self.num_top + 1]}
            return Draft(intro + " ".join(words), question, prefix, top, metadata)

        return Builder(build)
