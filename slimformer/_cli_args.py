"""Argument types and checks shared by the repository's command lines (``python -m slimformer.plan``,
``slimformer.memory``, bench/, tools/). Standard library only, so that a parser built from them
answers ``--help`` before torch is imported.

Each type raises ``argparse.ArgumentTypeError``, which argparse turns into a usage error (exit code 2)
that names the argument: ``error: argument --steps: expected an integer >= 1, got '0'``.
"""

import argparse
import os
from pathlib import Path


def _number(kind, least: float, *, above: bool = False, most: float | None = None, below: bool = False):
    """An argparse type: ``kind(text)`` >= ``least`` (> with ``above``), <= ``most`` (< with ``below``)."""
    name = "an integer" if kind is int else "a number"
    bound = f"> {least:g}" if above else f">= {least:g}"
    if most is not None:
        bound += f" and {'<' if below else '<='} {most:g}"

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

    convert.__name__ = f"{kind.__name__} {bound}"
    return convert


positive_int = _number(int, 1)
non_negative_int = _number(int, 0)
positive_float = _number(float, 0.0, above=True)
non_negative_float = _number(float, 0.0)
probability = _number(float, 0.0, most=1.0, below=True)  # a dropout probability: [0, 1)
fraction = _number(float, 0.0, above=True, most=1.0)  # a share of something: (0, 1]
unit_float = _number(float, 0.0, most=1.0)  # [0, 1]


def unwritable_reason(path: Path, *, folder: bool) -> str | None:
    """Why ``path`` (a folder to create or fill, or a file to write) cannot be written, or None.
    Nothing is created: the nearest existing folder must let this process add entries."""
    path = Path(path)
    if path.exists():
        if folder != path.is_dir():
            return f"{path} exists and is {'not ' if folder else ''}a folder"
        if folder and not os.access(path, os.W_OK | os.X_OK):
            return f"folder {path} is not writable"
        if not folder and not os.access(path, os.W_OK):
            return f"file {path} is not writable"
        return None
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} (on the way to {path}) is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"folder {parent} (where {path} would be created) is not writable"
    return None


def output_dir(text: str) -> Path:
    """A folder results go to: it or its nearest existing parent folder must be writable."""
    if reason := unwritable_reason(Path(text), folder=True):
        raise argparse.ArgumentTypeError(f"expected a writable folder, got {text!r}: {reason}")
    return Path(text)


def output_file(text: str) -> Path:
    """A file to write: its folder (or the nearest existing parent) must be writable."""
    if reason := unwritable_reason(Path(text), folder=False):
        raise argparse.ArgumentTypeError(f"expected a writable file path, got {text!r}: {reason}")
    return Path(text)
