"""swarm: collaborative training, remote experts, the ``swarm`` command, monitoring.

Today it holds the command line (``swarm.cli``); training arrives with the averaging
layer. Importing ``swarm`` stays light: torch-heavy modules are imported by name.
"""

__all__: list[str] = []
