"""--help text: each flag's default said once (the server's flags, moeserve/args.py, and the bench commands')."""

from __future__ import annotations

import argparse
from typing import Any


def with_default(help_text: str, default: Any) -> str:
    """help_text with its default said once: not where the text says it already, nor for None or False."""
    if default is None or default is False or default is argparse.SUPPRESS or "default" in help_text.lower():
        return help_text
    return f"{help_text} (default: {default})"


class DefaultsOnceHelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter without its repeats: no '(default: None)' after a help that says
    its default in words, no second '(default: ...)'."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if not action.option_strings or "%(default)" in help_text:
            return help_text
        return with_default(help_text, action.default)
