"""The CLI on a terminal: Ctrl-C in ``generate``, progress feedback in ``bench``.

Each command runs under a pseudo-terminal (stdout and stderr both a tty, as in an interactive shell)
on a tiny random model (tests/tiny.py); every wait is bounded. The pipe cases (no bars, no status
lines) are in tests/test_bench.py and tests/test_cli_first_run.py.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tiny import make_tiny_model_dir

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal (pty)")
CLI = [sys.executable, "-m", "mlx_infer"]


@pytest.fixture(scope="module")
def long_context(tmp_path_factory) -> Path:
    """A tiny llama with a context far beyond what a test lets it generate."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("terminal"), "llama", max_position_embeddings=1_000_000)


def _read(fd: int, until: float, *, once: bool) -> bytes:
    """What the terminal shows before ``until`` (monotonic) or the end of output; ``once``: the first chunk only."""
    out = b""
    while time.monotonic() < until:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal's other end
            break
        if not chunk:
            break
        out += chunk
        if once:
            break
    return out


def _spawn(args: list[str]) -> tuple[subprocess.Popen, int]:
    primary, secondary = pty.openpty()
    # a 24x120 window: a fresh pty is 0x0, and tqdm draws nothing in 0 columns
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    p = subprocess.Popen([*CLI, *args], stdin=secondary, stdout=secondary, stderr=secondary, close_fds=True)
    os.close(secondary)
    return p, primary


def _screen(shown: bytes) -> str:
    return shown.decode("utf-8", "replace").replace("\r\n", "\n")  # the tty's ONLCR turns "\n" into "\r\n"


def test_ctrl_c_stats_start_on_a_new_line(long_context):
    p, primary = _spawn(["generate", "--model", str(long_context), "--prompt", "hello",
                         "--max-tokens", "500000", "--ignore-chat-template"])
    try:
        shown = b""
        deadline = time.monotonic() + 120
        # the loading status line is "mlx-infer: loading ...", then cleared with "\r": wait for some text after it
        while time.monotonic() < deadline and p.poll() is None:
            shown += _read(primary, deadline, once=True)
            after = shown.rsplit(b"...", 1)[-1] if b"loading" in shown else b""
            if len(after.strip(b"\r ")) >= 40:
                break
        assert p.poll() is None, f"the run ended before Ctrl-C: {shown!r}"
        p.send_signal(signal.SIGINT)
        shown += _read(primary, time.monotonic() + 60, once=False)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(primary)
    screen = _screen(shown)
    assert "Traceback" not in screen, screen
    assert rc == 130, screen
    assert "\nprompt: " in screen, screen  # the stats line begins a line: not glued to the text
    stats = screen[screen.rindex("\nprompt: ") + 1:].splitlines()
    assert stats[1].startswith("generation: ") and stats[3] == "finish: cancelled", stats
    assert stats[-1] == "mlx-infer: interrupted", stats
    assert 0 < int(stats[1].split()[1]) < 500000, stats


def test_bench_shows_progress_from_start_to_end(long_context, tmp_path):
    """Loads, warm-ups, trials and the plot each show a status line or a bar on a terminal."""
    p, primary = _spawn(["bench", "--model", str(long_context), "--compare", "mlx-lm", "-p", "16", "-g", "8",
                         "-n", "2", "--plot", str(tmp_path / "r.png")])
    try:
        shown = _read(primary, time.monotonic() + 300, once=False)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(primary)
    screen = _screen(shown)
    assert rc == 0 and "Traceback" not in screen, screen
    for shown_while in ("mlx-infer: loading mlx-infer...", "mlx-infer: loading mlx-lm...",
                        "warm-up mlx-infer", "warm-up mlx-lm", "trial 1/2 mlx-infer", "trial 2/2 mlx-lm",
                        "mlx-infer: drawing the plot..."):
        assert shown_while in screen, (shown_while, screen)
    # each trial's line stands on a line of its own (tqdm.write), not inside the bar
    lines = [ln.split("\r")[-1] for ln in screen.split("\n")]
    assert sum(ln.startswith("trial ") and ": prompt " in ln for ln in lines) == 4, screen
