"""The plain vocabulary every layer shares: errors, reduce ops, nested structures, launcher environment.

Nothing here communicates or imports an engine; every other package may import it.
"""
