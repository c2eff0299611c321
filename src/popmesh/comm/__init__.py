"""The communication layer: World and Group, collectives, async collectives, point-to-point messages.

One meaning on every engine: the modules here prepare buffers, check agreement across ranks and
call the engine adapter behind :class:`~popmesh.engines.base.Engine`; they never name an engine.
"""
