"""State sync: a newcomer downloads a state from several donors at once, verified.

- :mod:`~averaging.state.manifest`: the pure part (wire messages, bounds, byte layout);
- :mod:`~averaging.state.schedule`: which chunk each donor fetches next (pure);
- :mod:`~averaging.state.sync`: the newcomer's download, :mod:`~averaging.state.donor`
  the donors' side, :mod:`~averaging.state.records` its config and reports;
- :mod:`~averaging.state.signing`: states signed with the run's operator key.

The names users need are exported by :mod:`averaging` (docs/averaging-state-sync.md).
"""
