"""One-line errors for every command line (infer, eval; train/cli.py can delegate here).

`run(main)` calls `main()`; a failure prints `error: <message>` on one line to stderr and exits
non-zero (2 for a user mistake, 1 for anything else), with the traceback only under `--debug` or
env `LOOPLM_DEBUG=1`. A user mistake is a `UserError`, a `ParamError` (a bad setting, naming its
parameter), a missing file or a bad value: its message is printed as is. Any other exception is
printed with its type and a pointer to `--debug`, since it is more likely a bug than a typo.
Sits at the bottom layer (no torch, no infer/eval/train imports) so every package may use it.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

from .errors import ParamError


class UserError(Exception):
    """A mistake in the command line or the inputs: printed as one `error:` line."""


USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ParamError, FileNotFoundError, NotADirectoryError,
                                               IsADirectoryError, PermissionError, ValueError)


def debug_enabled(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("LOOPLM_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def one_line(e: BaseException, debug: bool = False) -> tuple[str, bool]:
    """(the message for `error: ...`, whether it is a user mistake)."""
    user = isinstance(e, USER_ERRORS)
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in msg:
        msg = f"{msg}: {e.filename}"
    if not user:
        msg = f"{type(e).__name__}: {msg}" + ("" if debug else " (traceback: --debug or LOOPLM_DEBUG=1)")
    return msg, user


def run(main: Callable[..., object], argv: list[str] | None = None) -> None:
    """Call main(argv) (main() when argv is None: it reads sys.argv); turn failures into one
    `error:` line and a non-zero exit. `--debug` is taken out of the arguments here, so a CLI
    without a flag of its own accepts it too."""
    debug = debug_enabled(argv)
    if argv is None:
        if "--debug" in sys.argv:
            sys.argv.remove("--debug")
    else:
        argv = [a for a in argv if a != "--debug"]
    try:
        main() if argv is None else main(argv)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the point is to catch everything a user can meet
        if debug:
            traceback.print_exc()
        msg, user = one_line(e, debug)
        print(f"error: {msg}", file=sys.stderr, flush=True)
        sys.exit(2 if user else 1)
