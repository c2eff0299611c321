"""Who does what in a world: the pure rank layout, the same layout after the world changed size, and the
role groups built from it."""

from popmesh.topology.elastic import relayout, renumbering
from popmesh.topology.layout import LayoutWarning, RankLayout, Role

__all__ = ["LayoutWarning", "RankLayout", "Role", "relayout", "renumbering"]
