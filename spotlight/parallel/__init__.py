"""Parallel execution of the DiT policy: Ulysses sequence parallelism over replaceable process groups."""

from spotlight.parallel.ulysses import SPContext, UlyssesAttnProcessor, install_ulysses, ulysses_forward

__all__ = ["SPContext", "UlyssesAttnProcessor", "install_ulysses", "ulysses_forward"]
