"""The help format every `python -m ...` command of the project shares.

It lives in `contract`, the one package every other may import, and needs only the standard
library, so a command such as `python -m service.healthcheck` pays nothing for it.
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, except where a default says nothing: on/off
    switches (their name says it), unset values (None, whose help says what unset means) and
    help that words its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
