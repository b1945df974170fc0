"""Batches: streaming a finished batch into the sinks (runner, writer) and its progress in
Redis (:class:`~receiver.batches.progress.BatchState`)."""
