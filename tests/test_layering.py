"""The maths layer stays pure (docs/architecture.md): importing it loads neither transformers
nor probkv's policies, integration or evaluation; the policies do not load the integration."""

from __future__ import annotations

import json
import subprocess
import sys

MATHS = [
    "probkv.attention",
    "probkv.scores",
    "probkv.proposals",
    "probkv.sampling",
    "probkv.estimator",
    "probkv.budgets",
    "probkv.hardness",
    "probkv.selection",
    "probkv.reconstruction",
]
FORBIDDEN_FOR_MATHS = [
    "transformers",
    "probkv.policies",
    "probkv.hf",
    "probkv.eval",
    "probkv.models",
]
FORBIDDEN_FOR_POLICIES = ["transformers", "probkv.hf", "probkv.eval", "probkv.models"]

# Imports the modules one by one in a fresh interpreter and records, after each, which
# forbidden modules have been loaded so far: the first module that loads one is the culprit.
PROBE = """
import importlib, json, sys
steps = json.loads(sys.argv[1])
out = []
for module, forbidden in steps:
    importlib.import_module(module)
    out.append([module, [m for m in forbidden if m in sys.modules]])
print(json.dumps(out))
"""


def test_maths_and_policies_import_no_model_code():
    steps = [[m, FORBIDDEN_FOR_MATHS] for m in MATHS] + [
        ["probkv.policies", FORBIDDEN_FOR_POLICIES]
    ]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(steps)], capture_output=True, text=True, check=True
    )
    for module, loaded in json.loads(done.stdout):
        assert loaded == [], f"importing {module} loaded {loaded}"
