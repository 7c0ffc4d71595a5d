"""glibc's heap, seen and trimmed: what a rank's resident memory holds beyond its live tensors.

glibc's malloc keeps freed blocks under its mmap threshold in its heap (the threshold rises to 32
MiB as large blocks are freed), resident until reused. A step frees GBs at its phase ends (the
rollout's decode temporaries, the update's activations) that the next phase, of other shapes, only
partly reuses: a SmolLM2 rank held 2.5 GB free in its heap after a step. `trim()` (malloc_trim(0))
hands every whole free page back to the OS, so the resident peak follows the live tensors (what the
memory planner counts); `free_bytes()` (mallinfo2's fordblks) is how much the heap holds free.
Where the C library is not glibc both say so (False / nan) and do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


LIBC = _libc()
_TRIM = getattr(LIBC, "malloc_trim", None)
_INFO = getattr(LIBC, "mallinfo2", None)  # glibc 2.33+
if _INFO is not None:
    _INFO.restype = _MallInfo2


def trim() -> bool:
    """Returns the heap's free pages to the OS (glibc's malloc_trim(0)); False where there is no such call."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def free_bytes() -> float:
    """Bytes glibc's heap and arenas hold free (part of them resident); nan without mallinfo2."""
    return float(_INFO().fordblks) if _INFO is not None else float("nan")
