"""The one check of a timeout: every ``timeout=`` (and ``idle_timeout=``) popmesh takes goes through it.

A timeout is a positive, finite real number of seconds: an int or a float (numpy scalars and
fractions included). A string such as ``"1"``, a bool, zero, a negative number, NaN and infinity
are ConfigErrors naming the argument, raised where it is passed, not later in an engine.
"""

from __future__ import annotations

import math
import numbers

from popmesh.core.errors import ConfigError

__all__ = ["check_timeout", "resolve_timeout"]


def check_timeout(value: object, name: str = "timeout", what: str = "") -> float:
    """``value`` in seconds as a float; ConfigError naming ``name`` (and the call ``what``) otherwise."""
    where = f"{what}: " if what else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{where}{name}={value!r} must be a number of seconds (an int or a float), not a "
                          f"{type(value).__name__}")
    seconds = float(value)
    if not (seconds > 0 and math.isfinite(seconds)):  # NaN fails both tests
        raise ConfigError(f"{where}{name}={value!r} must be a positive, finite number of seconds (for a very long "
                          "wait pass a large number, e.g. 86400)")
    return seconds


def resolve_timeout(value: object, default: float, name: str = "timeout", what: str = "") -> float:
    """``default`` when ``value`` is None, else ``value`` checked by :func:`check_timeout`."""
    return default if value is None else check_timeout(value, name, what)
