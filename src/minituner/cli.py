"""The ``minituner`` command line: one module per subcommand under ``minituner/commands``.

A user's mistake (bad flag, missing file, corrupt adapter, wrong shape, NaN) ends in one line on
stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from minigpt.errors import InputError

# Subcommand name -> module in minituner.commands exposing HELP, add_arguments(parser), run(args) -> int.
COMMANDS = ("pretrain", "generate", "count", "finetune", "eval", "export", "memory-check")

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minituner", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"minituner.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean the user's input was wrong (not a bug in minituner)."""
    return (InputError, OSError, FloatingPointError)


def out_of_memory(e: BaseException) -> bool:
    """Whether an exception is the machine running out of memory (Python's, torch's CPU or CUDA allocator)."""
    text = str(e)
    return isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    before = _terminate_as_interrupt()
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # e.g. `minituner count --json | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except user_errors() as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"minituner {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except (MemoryError, RuntimeError) as e:  # torch's allocator raises RuntimeError (CPU) / OutOfMemoryError (CUDA)
        if not out_of_memory(e):
            raise
        print(f"minituner {args.command}: error: out of memory ({' '.join(str(e).split())[:160]}); "
              "minituner count plans what a run needs", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (_terminate_as_interrupt)
        said = f" ({e.args[0]})" if e.args else ""
        print(f"minituner: interrupted{said}", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `kill`'s stop), raised where Python is, so a run cleans up as after Ctrl-C."""


def _terminate_as_interrupt():
    """SIGTERM raises Terminated in the main thread while a command runs: a run stopped that way restores the
    folder an --overwrite replaced, as after Ctrl-C (the default handler ends the process with nothing cleaned up).
    The handler it replaces (None where none is set: off the main thread, or SIGTERM already handled)."""
    def stop(signum, frame):
        raise Terminated("SIGTERM")

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None  # (a handler of the caller's, or SIGTERM ignored by the parent: left as it is)
    return signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    raise SystemExit(main())
