"""The worker process: its lifecycle and typed state, the retry policy every job runs under,
the fetch jobs, the deliver job, the watch poller and the provider rate limiter."""
