"""_fast.install_crash_backtrace: a fatal signal prints the native stack, then the handler before runs."""

import subprocess
import sys

CRASH = """
import faulthandler, ctypes
faulthandler.enable()
from mlx_infer import _fast
assert _fast.install_crash_backtrace()
print("armed", flush=True)
ctypes.string_at(0)  # SIGSEGV
"""


def test_a_segfault_prints_the_native_then_the_python_stack():
    p = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=120)
    assert p.returncode == -11, (p.returncode, p.stderr[-2000:])
    assert "armed" in p.stdout
    native = p.stderr.index("[mlx_infer] fatal signal; native stack")
    assert "libc.so" in p.stderr[native:]  # frames with their libraries
    python = p.stderr.index("Fatal Python error: Segmentation fault")  # faulthandler ran after ours
    assert python > native and "string_at" in p.stderr[python:]
