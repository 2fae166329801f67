"""The layers of docs/architecture.md, checked on every module of probkv (found, not listed).

A module's layer is the first entry of ``LAYERS`` whose package prefix it has; a module in none
fails the test, so a new top-level module must be placed in a layer (nothing is "maths" by
default). Then:

- maths (the packages ``scores``, ``sampling``, ``estimation``, ``budgets`` and the shared input
  checks) imports neither transformers nor probkv's policies, integration, evaluation, model
  loading or CLI;
- the policies import neither transformers nor the integration, evaluation, models or CLI;
- the evaluation harness imports neither the experiments, the training nor the CLI; the
  experiments and the training import neither each other nor the CLI (the harness is what
  they share);
- the evaluation, experiments, training and CLI never touch transformers' attention registry
  nor switch a model's attention implementation: they run models through the integration
  (``probkv.hf``);
- no two probkv modules import each other, directly or through others;
- no two modules in different layers share a name (``probkv.hf.attention`` and a maths
  ``attention`` would read as one thing).

Each import rule is checked statically on the source (every import statement, inside
functions too, so a lazy import cannot hide), and the first two also at runtime in a fresh
interpreter (what importing a module really loads, through every module it imports).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import probkv

# layer -> the package prefixes it consists of, in the order of docs/architecture.md
LAYERS = {
    "maths": (
        "probkv._checks",
        "probkv.scores",
        "probkv.sampling",
        "probkv.estimation",
        "probkv.budgets",
    ),
    "policies": ("probkv.policies",),
    "hf": ("probkv.hf",),
    "vllm": ("probkv.vllm",),
    "models": ("probkv.models",),
    "eval": ("probkv.eval",),
    "experiments": ("probkv.experiments",),
    "training": ("probkv.training",),
    "cli": ("probkv.cli",),
}
HIGHER_LAYERS = tuple(
    p
    for name in ("policies", "hf", "vllm", "models", "eval", "experiments", "training", "cli")
    for p in LAYERS[name]
)
FORBIDDEN = {
    "maths": ("transformers", *HIGHER_LAYERS),
    "policies": ("transformers", *(p for p in HIGHER_LAYERS if p != "probkv.policies")),
}
# The layers above the integration, checked statically only (importing them loads transformers).
FORBIDDEN_ABOVE = {
    "eval": ("probkv.experiments", "probkv.training", "probkv.cli"),
    "experiments": ("probkv.training", "probkv.cli"),
    "training": ("probkv.experiments", "probkv.cli"),
}
# transformers' attention registry and implementation switch: only probkv.hf may use them.
ATTENTION_REGISTRY = {
    "AttentionInterface",
    "AttentionMaskInterface",
    "ALL_ATTENTION_FUNCTIONS",
    "ALL_MASK_ATTENTION_FUNCTIONS",
    "set_attn_implementation",
    "_attn_implementation",
    "attn_implementation",
}
REGISTRY_MODULES = ("transformers.modeling_utils", "transformers.masking_utils")


def discover() -> dict[str, Path]:
    """Every module of probkv (packages as their ``__init__``) -> its source file."""
    modules = {"probkv": Path(probkv.__file__)}
    for info in pkgutil.walk_packages(probkv.__path__, "probkv."):
        modules[info.name] = Path(importlib.util.find_spec(info.name).origin)
    return modules


MODULES = discover()


def layer(module: str) -> str:
    """The layer whose package prefix ``module`` has; ``"root"`` for ``probkv`` itself."""
    if module == "probkv":
        return "root"
    for name, prefixes in LAYERS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    raise AssertionError(f"{module} is in no layer of LAYERS: place it in docs/architecture.md's")


def imports(module: str) -> dict[str, bool]:
    """Modules ``module`` imports -> whether at module level (else inside a function or class).
    ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, bool] = {}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        for name in names:
            found[name] = found.get(name, False) or id(node) in top_level
    return found


def test_modules_are_discovered_and_each_is_in_a_layer():
    assert {
        "probkv.scores",
        "probkv.sampling.span_designs",
        "probkv.policies.base",
        "probkv.hf.cache",
        "probkv.eval.runner",
        "probkv.experiments.attention_error",
        "probkv.training.scorer",
    } <= set(MODULES)
    layers = {m: layer(m) for m in MODULES}  # raises for a module in no layer
    assert layers["probkv.scores"] == "maths" and layers["probkv.hf.cache"] == "hf"
    assert layers["probkv.models.testing"] == "models" and layers["probkv.cli.main"] == "cli"
    assert set(layers.values()) == {"root", *LAYERS}


def test_a_module_outside_every_layer_is_refused():
    try:
        layer("probkv.somewhere_new")
    except AssertionError as err:
        assert "no layer" in str(err)
    else:
        raise AssertionError("a module in no layer was given one")


def test_no_two_layers_share_a_module_name():
    by_name: dict[str, set[str]] = {}
    for module in MODULES:
        leaf = module.rpartition(".")[2]
        if leaf != "__init__" and layer(module) != "root" and not leaf.startswith("_"):
            by_name.setdefault(leaf, set()).add(layer(module))
    assert {n: sorted(ls) for n, ls in by_name.items() if len(ls) > 1} == {}


def test_no_forbidden_import_statements():
    """Every import statement of the maths, policies, evaluation, experiments and training
    layers, lazy ones included."""
    bad = []
    for module in MODULES:
        forbidden = FORBIDDEN.get(layer(module), ()) + FORBIDDEN_ABOVE.get(layer(module), ())
        bad += [
            f"{module} imports {name}" for name in imports(module) if name.startswith(forbidden)
        ]
    assert bad == []


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
    """What importing really loads (transitively), maths first, then the policies."""
    order = sorted(MODULES, key=lambda m: (layer(m) != "maths", m))
    steps = [[m, FORBIDDEN[layer(m)]] for m in order if layer(m) in FORBIDDEN]
    assert [m for m, _ in steps if layer(m) == "policies"]  # both layers are probed
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(steps)], capture_output=True, text=True, check=True
    )
    for module, loaded in json.loads(done.stdout):
        assert loaded == [], f"importing {module} loaded {loaded}"


def registry_uses(module: str) -> list[str]:
    """Where ``module``'s source names transformers' attention registry or implementation
    switch: identifiers, attributes, imported names, keyword arguments and string literals
    (a ``getattr(model, "set_attn_implementation")`` counts too)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    uses = []
    for node in ast.walk(tree):
        word = None
        if isinstance(node, ast.Name):
            word = node.id
        elif isinstance(node, ast.Attribute):
            word = node.attr
        elif isinstance(node, ast.alias):
            word = node.name.rpartition(".")[2]
        elif isinstance(node, ast.keyword):
            word = node.arg
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            word = node.value
        if word in ATTENTION_REGISTRY:
            uses.append(f"{module}:{getattr(node, 'lineno', '?')} {word}")
    uses += [f"{module} imports {m}" for m in imports(module) if m.startswith(REGISTRY_MODULES)]
    return uses


def test_evaluation_never_touches_the_attention_registry():
    """The evaluation, experiments, training and CLI use the integration's attention function
    through probkv.hf; only probkv.hf registers functions or switches a model's attention
    implementation."""
    above = ("eval", "experiments", "training", "cli", "maths", "policies")
    evaluation = [m for m in MODULES if layer(m) in above]
    assert "probkv.experiments.attention_error" in evaluation
    assert [use for m in evaluation for use in registry_uses(m)] == []
    assert registry_uses("probkv.hf.model")  # the check does see the integration's own use


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """No probkv module imports itself through others: neither at import time (module-level
    imports) nor through a lazy import inside a function (which would hide a real cycle)."""
    for lazy in (False, True):
        edges = {
            m: {name for name, top in imports(m).items() if name in MODULES and (top or lazy)}
            for m in MODULES
        }
        assert cycles(edges) == [], "lazy imports included" if lazy else "module-level imports"


def test_only_the_vllm_integration_imports_vllm_and_it_leaves_the_hf_one_alone():
    """Every vLLM-specific line lives in probkv.vllm, which shares nothing with probkv.hf: the
    two integrations meet only in the layers below (maths, policies)."""
    bad = []
    for module in MODULES:
        for name in imports(module):
            if (name == "vllm" or name.startswith("vllm.")) and layer(module) != "vllm":
                bad.append(f"{module} imports {name}")
            if layer(module) == "vllm" and name.startswith("probkv.hf"):
                bad.append(f"{module} imports {name}")
            if layer(module) == "hf" and name.startswith("probkv.vllm"):
                bad.append(f"{module} imports {name}")
    assert bad == []


def test_only_the_cli_reads_argparse():
    """Every command of the command line lives in probkv.cli, which turns the parsed arguments
    into calls of typed entry points: no other module imports argparse (so none takes an
    ``argparse.Namespace``), and the CLI imports its command modules statically (no
    ``importlib``: an import by name hides an edge of the import graph)."""
    outside = [m for m in MODULES if layer(m) != "cli" and "argparse" in imports(m)]
    assert outside == []
    by_name = [
        m
        for m in MODULES
        if layer(m) == "cli" and any(n.split(".")[0] == "importlib" for n in imports(m))
    ]
    assert by_name == []
    assert "argparse" in imports("probkv.cli.main")  # the check does see an import of argparse


def source_lines(prefix: str) -> int:
    return sum(
        len(path.read_text(encoding="utf-8").splitlines())
        for module, path in MODULES.items()
        if module == prefix or module.startswith(prefix + ".")
    )


def test_the_evaluation_harness_is_under_a_quarter_of_the_source():
    """Issue 41: ``probkv.eval`` holds the harness only (data, tasks, runner, store, scoring,
    summary, its plots); experiments and training live in their own packages."""
    share = source_lines("probkv.eval") / source_lines("probkv")
    assert 0 < share < 0.25, f"probkv.eval is {share:.1%} of probkv's source lines"


def private_uses(module: str) -> list[str]:
    """The private names (``_x``, not dunder) ``module`` takes from another probkv module:
    ``from probkv.m import _x`` and ``m._x`` on a probkv module it imported as ``m``."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> probkv module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif base in MODULES and a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{module} imports {base}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{module} reads {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore is its module's own: another module that needs it
    needs a public name (issue 41), in the vLLM plugin too (vLLM's own private names are read in
    ``probkv.vllm.internals`` alone: its test)."""
    assert [use for m in MODULES for use in private_uses(m)] == []


def test_private_uses_sees_both_spellings(tmp_path, monkeypatch):
    source = "from probkv.sampling import _x\nfrom probkv.hf import guards\nguards._y()\n"
    path = tmp_path / "probe.py"
    path.write_text(source, encoding="utf-8")
    monkeypatch.setitem(MODULES, "probkv.probe", path)
    assert private_uses("probkv.probe") == [
        "probkv.probe imports probkv.sampling._x",
        "probkv.probe reads probkv.hf.guards._y",
    ]


MAX_FUNCTION_LINES = 100


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (or method) of probkv longer than ``limit`` lines, its decorators and
    docstring included."""
    out = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > limit:
                    out.append(f"{module}.{node.name}: {node.end_lineno - first + 1} lines")
    return out


def test_no_function_is_over_100_lines():
    """Issue 41: a function a newcomer can read in one screenful or two; split longer ones
    into named steps (as ``probkv.eval.runner.run_eval`` is)."""
    assert long_functions() == []
    assert long_functions(limit=60)  # the check does see functions and count their lines
