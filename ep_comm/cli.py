"""argparse value types shared by the command lines (benchmark, soak, examples)."""
from __future__ import annotations

import argparse
from typing import Callable, List


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= {minimum}")
        return value

    return parse


def int_list(what: str, minimum: int, example: str) -> Callable[[str], List[int]]:
    """argparse type: a comma- or space-separated list of integers >= ``minimum`` (``what`` names them)."""
    def parse(text: str) -> List[int]:
        try:
            values = [int(v) for v in text.replace(",", " ").split()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a list of {what} >= {minimum}, e.g. {example}")
        return values

    return parse
