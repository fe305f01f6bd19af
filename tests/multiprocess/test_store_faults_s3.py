"""Storage faults on purpose against a real S3 API (moto_server on loopback, under s3fs): the same walk of
every write, move (copy and delete, on an object store) and delete of commit, retention and discard_after
as tests/unit/test_store_faults.py, and a read outage that raises instead of reading as "no checkpoint"."""

from __future__ import annotations

import pytest

from cluster.run.checkpoint import CheckpointStore, CheckpointUnreadableError
from cluster.run.storage import Storage
from tests.support.faultfs import Faults
from tests.support.storage import MotoS3
from tests.support.store_faults import SCENARIOS, Scenario, commit, s3_backend, walk

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_every_injection_point_keeps_what_verified_on_s3(moto_s3: MotoS3, scenario: Scenario) -> None:
    walked = walk(s3_backend(moto_s3.bucket, moto_s3.direct_options), scenario)  # no outage: past the relay
    assert len(walked) >= 8


def test_a_read_outage_on_s3_raises_and_never_reads_as_no_checkpoint(moto_s3: MotoS3) -> None:
    commit(CheckpointStore(Storage(moto_s3.url("runs/outage"), moto_s3.options)), 10)
    faults = Faults()
    faults.read_outage(paths="model.pt")
    opts = {"faults": faults, "target_protocol": "s3", "target_options": moto_s3.options}
    store = CheckpointStore(
        Storage(f"fault://{moto_s3.bucket}/runs/outage", opts, retries=0, retry_budget_s=0)
    )
    with pytest.raises(CheckpointUnreadableError, match="cannot read the checkpoint at fault://"):
        store.load_latest()
    moto_s3.pause()  # the server itself stops answering: listing fails too
    try:
        down = CheckpointStore(
            Storage(moto_s3.url("runs/outage"), moto_s3.options, retries=0, retry_budget_s=0)
        )
        with pytest.raises(CheckpointUnreadableError, match=r"cannot (list|read) the checkpoint"):
            down.load_latest()
    finally:
        moto_s3.resume()
