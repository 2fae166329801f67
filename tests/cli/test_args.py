"""argparse value types shared by the subcommands (probkv.cli.args), and the import graph of
the command line: command modules do not import probkv.cli.main, ``--help`` loads no model code."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from probkv.cli.args import (
    comma_list,
    length_list,
    max_threads,
    output_path,
    positive_int,
    ratio_list,
    thread_count,
)


def test_valid_values():
    assert positive_int("3") == 3
    assert comma_list(" a, b ,c") == ["a", "b", "c"]
    assert ratio_list("0,0.5,0.99") == [0.0, 0.5, 0.99]
    assert length_list("2048,4096") == [2048, 4096]
    assert thread_count("1") == 1 and thread_count(str(max_threads())) == max_threads()
    assert output_path("out") == "out" and output_path(".") == "."


@pytest.mark.parametrize(
    ("parse", "bad", "message"),
    [
        (positive_int, "0", "integer >= 1, got '0'"),
        (positive_int, "x", "integer >= 1, got 'x'"),
        (comma_list, "a,,b", "comma-separated list, got 'a,,b'"),
        (comma_list, " ", "comma-separated list"),
        (ratio_list, "0.5,1", r"\[0, 1\) \(fraction evicted\), got '1'"),
        (ratio_list, "half", "got 'half'"),
        (length_list, "100,-1", "integer >= 1, got '-1'"),
        (thread_count, "0", "integer >= 1, got '0'"),
        (thread_count, "99999", r"at most \d+ \(4 x the \d+ CPUs of this machine.*got '99999'"),
        (output_path, "", "must be a file or folder path, got ''"),
        (output_path, "  ", "an empty path"),
    ],
)
def test_bad_values_name_the_value(parse, bad, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(bad)


# Runs in a fresh interpreter: which modules each step has loaded so far.
PROBE = """
import json, sys
import probkv.cli.eval_commands, probkv.cli.experiment_commands
import probkv.cli.model_commands, probkv.cli.train_scorer_command
after_commands = "probkv.cli.main" in sys.modules
from probkv.cli import main as cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
heavy = [m for m in ("transformers", "matplotlib", "probkv.hf") if m in sys.modules]
print(json.dumps([after_commands, heavy]))
"""


def test_command_modules_do_not_import_the_cli_and_help_loads_no_model_code():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    after_commands, heavy = json.loads(done.stdout.splitlines()[-1])
    assert after_commands is False  # no cli -> commands -> cli cycle
    assert heavy == []  # `probkv --help` stays fast: no transformers, matplotlib or hf
