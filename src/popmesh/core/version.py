"""popmesh's version, kept where every layer may read it (a joining process checks it against the world's)."""

__version__ = "0.2.0"
