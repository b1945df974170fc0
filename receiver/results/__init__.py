"""The results API (``/results/...``): reads, the live stream and long-poll waits."""
