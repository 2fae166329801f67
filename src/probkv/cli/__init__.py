"""The ``probkv`` command line: ``main`` (the entry point and the subcommands' wiring) and
``args`` (the argparse value types the subcommands share). Importing the package loads
neither, so a command module can use ``probkv.cli.args`` without importing the CLI."""
