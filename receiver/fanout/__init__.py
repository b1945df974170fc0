"""Fan-out: the opened sinks and the write of every envelope to its routed sinks, results
publication, and sink health."""
