"""What a command of the central services says when it refuses its flags or files."""

from __future__ import annotations

from typing import Any

from consumers._cli import main


def refused(capsys: Any, argv: list[str]) -> str:
    """What the command said when it refused ``argv`` with exit status 2 (argparse's own
    errors exit; the commands' return 2), with no traceback."""
    status: int | str | None
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    err: str = capsys.readouterr().err
    assert "Traceback" not in err
    return err
