"""The ``train-scorer`` subcommand (registered in ``probkv.cli.main``): train a kvzap scorer.

``probkv train-scorer --model NAME_OR_PATH --out FILE`` runs
``probkv.training.scorer.train_scorer`` (KVzip's reconstruction score as the teacher on
contexts probkv generates, a ridge fit per layer) and writes the scorer file; the teacher
statistics of each context go to ``--work`` (default ``FILE.work/``), so a rerun resumes.
The handler imports the trainer (transformers) only when it runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from probkv.cli.args import add_dtype_argument, positive_int
from probkv.eval.outputs import check_output_file, check_output_folder
from probkv.models import DEFAULT_MODEL


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``train-scorer``."""
    p = subparsers.add_parser(
        "train-scorer",
        help="train the kvzap surrogate scorer of a model (KVzip as teacher, ridge per layer)",
        description=(
            "Score generated training contexts with KVzip's reconstruction pass and fit, per "
            "layer, a linear surrogate from the layer's keys and values to each KV head's "
            "log-score. Prints held-out rank correlation per layer and the overlap with the "
            "teacher's kept set at r = 0.5 / 0.75 / 0.9. Resumable (--work)."
        ),
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"name, .gguf or folder (default {DEFAULT_MODEL})"
    )
    p.add_argument("--out", required=True, help="the scorer file to write (.pt)")
    p.add_argument("--work", help="folder of per-context teacher statistics (default OUT.work)")
    p.add_argument("--contexts", type=positive_int, default=96, help="contexts (default 96)")
    p.add_argument(
        "--heldout", type=positive_int, default=8, help="held-out contexts, >= 2 (default 8)"
    )
    p.add_argument("--length", type=positive_int, default=2048, help="tokens each (default 2048)")
    p.add_argument(
        "--teacher",
        choices=("kvzip", "kvzip-plus"),
        default="kvzip",
        help="the score fitted (default kvzip; kvzip-plus: KVzap's KVzip+, the attention "
        "weighted by ||W_o v|| / ||h||)",
    )
    p.add_argument(
        "--form",
        choices=("linear", "mlp"),
        default="linear",
        help="the scorer's form (default linear: a ridge fit; mlp: KVzap's two layers, a GELU "
        "hidden layer beside the ridge fit it starts from; both are reported held out)",
    )
    p.add_argument(
        "--hidden", type=positive_int, default=64, help="the MLP's hidden units (default 64)"
    )
    add_dtype_argument(p)
    p.set_defaults(handler=run_train_scorer)


def run_train_scorer(args: argparse.Namespace) -> int:
    """Train, write the file, print the held-out metrics."""
    out = Path(args.out)
    check_output_file(out, "--out")
    work = Path(args.work) if args.work else out.with_name(out.name + ".work")
    check_output_folder(work, "--work")
    import torch

    from probkv.eval.job import load_prepared_model
    from probkv.scores.surrogate import save_scorer
    from probkv.training.scorer import train_scorer

    start = time.perf_counter()
    model, tokenizer = load_prepared_model(args.model, torch.get_num_threads(), args.dtype)
    scorer = train_scorer(
        model,
        tokenizer,
        name=str(args.model),
        work_dir=work,
        contexts=args.contexts,
        heldout=args.heldout,
        length=args.length,
        teacher=args.teacher,
        form=args.form,
        hidden=args.hidden,
    )
    digest = save_scorer(scorer, out)
    m = scorer.metrics
    for kind, row in m["by_features"].items():
        overlap = ", ".join(f"r={r}: {v:.3f}" for r, v in row["kept_overlap"].items())
        print(
            f"features {kind:<9} alpha={row['alpha']:g} spearman={row['spearman_mean']:.3f} "
            f"kept overlap {overlap}"
        )
    for form, row in m["by_form"].items():
        overlap = ", ".join(f"r={r}: {v:.3f}" for r, v in row["kept_overlap"].items())
        print(f"form {form:<6} spearman={row['spearman_mean']:.3f} kept overlap {overlap}")
    print(
        f"spearman per layer ({scorer.form}):",
        json.dumps({k: round(v, 3) for k, v in m["spearman_per_layer"].items()}),
    )
    print(f"wrote {out} (digest {digest[:16]}); {time.perf_counter() - start:.0f} s in all")
    return 0
