"""Butterfly all-reduce: one round as a pure state machine and its network driver.

- :mod:`~averaging.allreduce.butterfly`: a round from one member's point of view (pure);
  its records in :mod:`~averaging.allreduce.records`, which coordinates each member
  reduces in :mod:`~averaging.allreduce.partition`, a part's two halves in
  :mod:`~averaging.allreduce.reduction`;
- the end of a round: :mod:`~averaging.allreduce.agreement` (the vote on the result),
  :mod:`~averaging.allreduce.accusations` (who may exclude whom);
- aggregation options: :mod:`~averaging.allreduce.robust` (CenteredClip),
  :mod:`~averaging.allreduce.replicated` (several reducers per part),
  :mod:`~averaging.allreduce.feedback` (error feedback for lossy codecs);
- the network: :mod:`~averaging.allreduce.network` runs a round over streams,
  :mod:`~averaging.allreduce.wire` its messages, :mod:`~averaging.allreduce.service`
  routes incoming links to rounds, :mod:`~averaging.allreduce.config` its settings and
  outcome, :mod:`~averaging.allreduce.buffers` the reused float32 buffers;
- :mod:`~averaging.allreduce.fault_checker`: random fault schedules against real rounds.

The names users need are exported by :mod:`averaging` (docs/averaging.md).
"""
