"""``swarm dashboard``: one page, served on this machine, that shows a swarm live.

The page's data come from the swarm's own status records (:mod:`swarm.status`), read by
a client peer in the dashboard process every few seconds; :mod:`.history` keeps what
changed between reads (each run's samples, throughput and loss over time, peers joining
and leaving, rounds and failed rounds); :mod:`.server` serves the page, its script and
``/api/view``. See docs/monitoring.md.
"""

from swarm.dashboard.history import History
from swarm.dashboard.server import DashboardServer

__all__ = ["DashboardServer", "History"]
