"""Where work runs: worker bootstrap per pool with environment probes, and command runners
(local processes, SSH) that stream their output."""
