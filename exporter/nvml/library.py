"""Which libnvidia-ml pynvml talks to: the real one (loaded lazily by pynvml) or the simulator's fake.

pynvml resolves every C symbol through the module-level `nvmlLib` and caches the lookups; it loads the real
shared object only while `nvmlLib` is unset. Installing the fake therefore means: set it, clear the cache,
reset the init refcount. Nothing above this module knows which library answers.
"""

from __future__ import annotations

from typing import Any

import pynvml


def install(library: Any) -> None:
    """Put `library` beneath pynvml (None restores lazy loading of the real libnvidia-ml.so.1)."""
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
