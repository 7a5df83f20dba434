"""`verispec models`: list the named default models."""

from __future__ import annotations

import argparse

from verispec.models.registry import NAMED_MODELS


def add_parser(sub) -> None:
    sub.add_parser("models", help="list the named default models")


def run(_: argparse.Namespace) -> int:
    for model in NAMED_MODELS.values():
        print(f"{model.name}\t{model.filename}\tsha256 {model.sha256}\t{len(model.packages)} package(s)")
    return 0
