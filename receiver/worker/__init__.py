"""The worker process: its lifecycle and typed state, the retry policy every job runs under,
the fetch jobs, the deliver job, the watch poller, the provider rate limiter, and
the heartbeat that also publishes the accounts the process serves (liveness)."""
