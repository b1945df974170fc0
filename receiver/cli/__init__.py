"""The ``nopoll`` command line.

One module per command group (``_serve``: serve, api, worker; ``_dlq``; ``_config``;
``_batch``: fetch-batch; ``_demo``; ``_try``: simulate, send-test; ``_watch``; ``_submit``;
``_endpoint``; ``_results``: results get, tail), each adding its commands through
``register(sub)``. Config problems print one clear message and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nopoll.exceptions import ConfigError, NopollError
from receiver.cli import (
    _batch,
    _config,
    _demo,
    _dlq,
    _endpoint,
    _results,
    _serve,
    _submit,
    _try,
    _watch,
)

__all__ = ["main"]

_COMMANDS = (_serve, _dlq, _config, _batch, _demo, _try, _watch, _submit, _endpoint, _results)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nopoll",
        description="Webhook receiver and result sink for asynchronous LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nopoll`` console script."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"nopoll: {exc}", file=sys.stderr)
        return 2
    except NopollError as exc:
        print(f"nopoll: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
