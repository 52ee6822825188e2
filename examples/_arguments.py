"""Argument types of the examples' command lines (the examples use slimformer's public API only,
so they keep these few of their own). Each raises ``argparse.ArgumentTypeError``: argparse then
stops with a usage error (exit code 2) naming the argument, e.g.
``error: argument --steps: expected an integer >= 1, got '0'``."""

import argparse
import os
from pathlib import Path


def _number(kind, least: float, *, above: bool = False, most: float | None = None, below: bool = False):
    """An argparse type: ``kind(text)`` >= ``least`` (> with ``above``), <= ``most`` (< with ``below``)."""
    name = "an integer" if kind is int else "a number"
    bound = (f"> {least:g}" if above else f">= {least:g}") + (
        "" if most is None else f" and {'<' if below else '<='} {most:g}"
    )

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name} {bound}, got {text!r}") from None
        inside = value >= least and (value != least or not above)  # False for nan
        if most is not None:
            inside = inside and value <= most and (value != most or not below)
        if not inside:
            raise argparse.ArgumentTypeError(f"expected {name} {bound}, got {text!r}")
        return value

    return convert


positive_int = _number(int, 1)
non_negative_int = _number(int, 0)
positive_float = _number(float, 0.0, above=True)
probability = _number(float, 0.0, most=1.0, below=True)  # a dropout probability: [0, 1)
unit_float = _number(float, 0.0, most=1.0)  # [0, 1]


def existing_dir(text: str) -> Path:
    """A model folder that must exist."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"expected an existing folder, got {text!r}")
    return Path(text)


def output_file(text: str) -> Path:
    """A file to write: the nearest existing folder on its way must be a writable folder."""
    parent = Path(text).parent
    while not parent.exists():
        parent = parent.parent
    if Path(text).is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"expected a writable file path, got {text!r}")
    return Path(text)
