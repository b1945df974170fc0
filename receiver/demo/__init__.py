"""The demo and the provider simulator: for trying and testing nopoll, never imported by
the service itself (``nopoll serve``, ``api`` and ``worker`` do not load this package).

- :mod:`receiver.demo.simulator`: the simulator, a real HTTP server on 127.0.0.1
  (``python -m receiver.demo.simulator``, ``nopoll simulate``).
- :mod:`receiver.demo.responses`: Responses objects and signed callbacks.
- :mod:`receiver.demo.batches`: batches in the four dialects, generated row by row.
- :mod:`receiver.demo.profiles`: how the simulator serves and creates each dialect's batches.
- :mod:`receiver.demo.answers`: streamed answers, gzip and oversized ones.
- :mod:`receiver.demo.run`: ``nopoll demo``.
"""
