"""`kvmem schema`: the scenario format's JSON Schema, for an editor to complete and check
scenario files (harness.scenario.file_schema); the schema is built from the scenario model,
imported when the command runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from . import options


def schema(args: argparse.Namespace, console: Console) -> int:
    """Print the schema, or write it to `--out` whole or not at all."""
    from ..scenario.file_schema import render

    text = render()
    if not args.out:
        sys.stdout.write(text)
        return 0
    options.write(Path(args.out), text)
    console.print(f"wrote {args.out}", highlight=False)
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    """`schema`."""
    parser = sub.add_parser(
        "schema", help="write the scenario format's JSON Schema, for an editor's YAML language "
                       "server",
        description="Write the JSON Schema of kvmem's scenario files. Point a scenario at it "
                    "with a first line `# yaml-language-server: $schema=kvmem.schema.json` "
                    "and an editor with the YAML language server completes and checks it.")
    parser.add_argument("-o", "--out", metavar="FILE",
                        help="write the schema to FILE instead of stdout")
    parser.set_defaults(handler=schema)
