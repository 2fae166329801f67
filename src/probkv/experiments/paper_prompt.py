"""The input of the paper's attention-error experiment (Figure 2), as data (S7).

Quoted verbatim, for the purpose of reproducing the measurement, from Appendix E ("Prompt and
Question for MAE Error") of: Renato Geh, Alex Chen, Daniel Israel, Aditya Grover and Guy Van
den Broeck, *A Probabilistic Interpretation of KV Cache Eviction* (University of California,
Los Angeles). The copyright of the quoted text stays with its authors.

What the paper does with it (Appendix E, Section 6): "the prompt x consists of the tokenization
of the following text" (``PAPER_TEXT``), and "the first token y is given by the first element in
the tokenized sequence of the following string" (``PAPER_QUESTION``). No chat template is
mentioned: the prompt is the plain text, and the measured decode token is the question's first
token (``"Who"``), not a generated answer. SmolLM2's tokenizer (no BOS) makes ``PAPER_TEXT``
157 tokens, the length S9's first table reports.
"""

from __future__ import annotations

#: Where the quoted text comes from.
PAPER_SOURCE = (
    "R. Geh, A. Chen, D. Israel, A. Grover, G. Van den Broeck, "
    "'A Probabilistic Interpretation of KV Cache Eviction', Appendix E"
)

#: The prompt x: two paragraphs separated by a blank line.
PAPER_TEXT = (
    "The Roman Empire was one of the largest and most enduring political entities in ancient "
    "history, reaching its greatest extent under Emperor Trajan in 117 CE when it spanned "
    "from Britain to Mesopotamia. Rome evolved from a monarchy to a republic before Julius "
    "Caesar's assassination in 44 BCE precipitated civil wars. Augustus emerged victorious "
    "and became the first emperor in 27 BCE, initiating a period of relative peace known as "
    "the Pax Romana."
    "\n\n"
    "Roman law, architecture, and administrative practices shaped European civilization for "
    "centuries. Latin, the language of the Romans, evolved into the Romance languages "
    "including French, Spanish, Italian, Portuguese, and Romanian. The western empire "
    "collapsed in 476 CE, while the eastern half survived as the Byzantine Empire for nearly "
    "a thousand more years."
)

#: The string whose first token is the measured decode token y.
PAPER_QUESTION = "Who was the first Roman emperor?"
