"""Matchmaking: peers that want to average under one key form groups through the DHT.

- :mod:`~averaging.matchmaking.search`: one search for a group, a pure state machine;
- :mod:`~averaging.matchmaking.matchmaker`: its driver over the DHT and streams;
- :mod:`~averaging.matchmaking.records`: its config, bounds, errors and the group formed.

The names users need are exported by :mod:`averaging` (docs/averaging-matchmaking.md).
"""
