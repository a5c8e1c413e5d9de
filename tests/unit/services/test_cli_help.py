"""Every `pdserve` subcommand prints its help: argparse %-formats help text, so a flag
whose help holds a literal '%' ("50% slower") once broke `pdserve gateway --help`."""

from __future__ import annotations

import argparse

import pytest

from services.cli.main import build_parser


def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


@pytest.mark.parametrize("command", _subcommands())
def test_help_prints(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: pdserve {command}" in capsys.readouterr().out
