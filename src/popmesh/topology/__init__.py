"""Who does what in a world: the pure rank layout and the role groups built from it."""

from popmesh.topology.layout import LayoutWarning, RankLayout, Role

__all__ = ["LayoutWarning", "RankLayout", "Role"]
