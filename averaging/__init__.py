"""averaging: compression, butterfly all-reduce, gossip, matchmaking, state sync.

Not built yet; it arrives with the averaging issue. Layering: imports ``peers`` only.
"""

__all__: list[str] = []
