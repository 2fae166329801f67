"""Experiments that measure the methods beyond the evaluation's task scores (S7, S10.5).

Each runs models through the integration (``probkv.hf``) and has one typed entry point that
``probkv.cli`` calls (docs/architecture.md, "Experiments"):

- :mod:`.attention_error`: the attention error of top-k, uncorrected and corrected eviction on
  one prompt (``probkv attention-error``; the run in :mod:`.attention_error_run`, its prompts
  in :mod:`.attention_prompts` and :mod:`.paper_prompt`, its figure in
  :mod:`.attention_error_plot`);
- :mod:`.method_attention_error`: the same error for whole methods on the examples ``probkv
  eval`` runs (``probkv task-attention-error``);
- :mod:`.long_decode`: teacher-forced long decoding under a decode budget (``probkv
  long-decode``; its figure in :mod:`.long_decode_plot`);
- :mod:`.demo`: the answers each method keeps as the cache shrinks (``probkv demo``).

Importing the package loads none of them.
"""
