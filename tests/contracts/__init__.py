"""The providers' published contracts as strict pydantic models, written by us.

One module per provider whose API has no official SDK to judge the simulator with
(:mod:`~tests.contracts.sference`, :mod:`~tests.contracts.sail`,
:mod:`~tests.contracts.valar`); each module's docstring names the public file and commit
its models were written from. OpenAI's and Anthropic's shapes are judged by their own SDKs'
models (``tests/receiver/demo/test_simulator_sdk_models.py``). The tests hold every answer
of the provider simulator, and every body nopoll sends, to these models.
"""
