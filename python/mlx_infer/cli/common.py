"""What every command of the CLI shares: the one-line-error parser, UTF-8 checks, the status line."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from typing import Iterator, NoReturn

from ..errors import MlxInferError


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ... (see prog --help)``), exit 2,
    and whose ``--help`` shows every default."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _utf8(flag: str, text: str | None) -> str | None:
    """``text`` unless it holds bytes that were not UTF-8 (Python maps them to lone surrogates)."""
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise MlxInferError(f"{flag} is not valid UTF-8 text; pass it UTF-8 encoded.") from None
    return text


@contextmanager
def _status(what: str) -> Iterator[None]:
    """``mlx-infer: WHAT...`` on stderr while the block runs (a terminal only; the line is cleared after)."""
    if not sys.stderr.isatty():
        yield
        return
    line = f"mlx-infer: {what}..."
    sys.stderr.write(line)
    sys.stderr.flush()
    try:
        yield
    finally:
        sys.stderr.write("\r" + " " * len(line) + "\r")
        sys.stderr.flush()


#: SamplingParams field -> the generate/serve flag that sets it (so messages name what the user typed).
_SAMPLING_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                   "repetition_penalty": "--repetition-penalty", "seed": "--seed"}


def _in_flag_words(message: str) -> str:
    """A library message in the CLI's words: ``SamplingParams.top_p`` -> ``--top-p``, ``overwrite=True`` ->
    ``--overwrite``."""
    import re

    message = re.sub(r"SamplingParams\.(\w+)", lambda m: _SAMPLING_FLAGS.get(m.group(1), m.group(0)), message)
    message = re.sub(r"^group_size must be", "--q-group-size must be", message)
    return message.replace("pass overwrite=True (--overwrite)", "pass --overwrite")
