"""Denormal floats flushed to zero on the threads that run the graphs.

ALiBi's bias reaches -slope x distance, so at long contexts most of a row's attention weights
underflow, and the CPU's slow path for denormal floats then took most of the attention kernel:
alibi's prompt graph, 65 tokens after 1,536 cached, ran 23 ms with denormals and 7 ms without
(docs/measurements.md). ONNX Runtime sets flush-to-zero and denormals-are-zero on its intra-op pool
threads when a session asks (`session.set_denormal_as_zero`), and on the thread that creates the
process's first session only; the calling thread computes a share of every parallel kernel too,
so each thread that runs a graph sets its own flags (x86-64 MXCSR through glibc's fenv; a no-op
elsewhere). A denormal is below 1.2e-38: flushing it changes no result beyond the parity limits.

The flags are state of the process's threads (new threads inherit them, and other code notices:
Hypothesis refuses to run where subnormal floats cannot be represented), so a process opts in with
`enable()` before its first session: the engine core and `python -m bench` do; a library user or a
test process that only builds runners keeps IEEE behaviour.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

MXCSR_OFFSET = 28  # glibc's x86-64 fenv_t: the x87 environment (28 bytes), then MXCSR
FLUSH_TO_ZERO, DENORMALS_ARE_ZERO = 1 << 15, 1 << 6

_done = threading.local()
_enabled = False


def enable() -> None:
    """Flush denormals in this process's graph calls from now on (before its first session)."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    return _enabled


def _libm() -> ctypes.CDLL | None:
    if platform.machine() not in ("x86_64", "AMD64") or platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    except OSError:
        return None


_LIBM = _libm()


def mxcsr() -> int | None:
    """This thread's MXCSR (None where it cannot be read)."""
    if _LIBM is None:
        return None
    env = (ctypes.c_ubyte * 64)()  # fenv_t is 32 bytes; room to spare
    if _LIBM.fegetenv(env) != 0:
        return None
    return ctypes.c_uint32.from_buffer(env, MXCSR_OFFSET).value


def flags_cleared_on_this_thread() -> None:
    """Another runtime cleared this thread's flags (onnxruntime-genai's own ONNX Runtime does when
    it makes a session: MXCSR 0x9ff0 -> 0x1fb2, and alibi's 2,048-token prompt through our runner
    then took 279 ms instead of 97): the next graph call on this thread sets them again."""
    _done.set = False


def flush_denormals_on_this_thread() -> None:
    """Set flush-to-zero and denormals-are-zero for the calling thread, once per thread (when enabled)."""
    if not _enabled or getattr(_done, "set", False):
        return
    _done.set = True
    if _LIBM is None:
        return
    env = (ctypes.c_ubyte * 64)()
    if _LIBM.fegetenv(env) != 0:
        return
    flags = ctypes.c_uint32.from_buffer(env, MXCSR_OFFSET)
    flags.value |= FLUSH_TO_ZERO | DENORMALS_ARE_ZERO
    _LIBM.fesetenv(env)
