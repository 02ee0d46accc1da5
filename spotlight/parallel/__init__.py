"""Parallel execution of the DiT policy: Ulysses sequence parallelism over replaceable process groups.

The attention core is ours or xDiT's USP (`SPContext(backend=...)`, `parallel.sp_backend`);
`xfuser_usp` imports xfuser only when that backend is asked for.
"""

from spotlight.parallel.ulysses import SP_BACKENDS, SPContext, UlyssesAttnProcessor, install_ulysses, ulysses_forward

__all__ = ["SP_BACKENDS", "SPContext", "UlyssesAttnProcessor", "install_ulysses", "ulysses_forward"]
