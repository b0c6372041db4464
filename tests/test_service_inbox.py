"""The store's inbox a farm service takes jobs from (storage/service_jobs.py, ServiceInbox), on a
local store, SeaweedFS and moto: what a client posts is read back until the service is done with
it; entries a farm client did not write are refused, the oversized one unread; the heartbeat
says whether a service watches the store. The service's side, on Ray: tests/test_service.py."""
from __future__ import annotations

import json
import time

import pytest

from storage import store_from_uri
from storage.service_jobs import ALIVE, ANSWERS, CANCELS, INBOX, INBOX_MAX_BYTES, ServiceInbox


def test_entries_are_read_back_until_done_and_foreign_ones_are_refused(store):
    inbox = ServiceInbox(store)
    spec = {"graphs": [{"path": "blob://sha256/" + "0" * 64}], "targets": ["aoti-cpu"]}
    inbox.post("mine-20261126-000000-abcd", spec, "interactive")
    store.backend.write(f"{INBOX}not a job id.json", b"{}")
    store.backend.write(f"{INBOX}big-1.json", b" " * (INBOX_MAX_BYTES + 1))
    store.backend.write(f"{INBOX}junk-1.json", json.dumps({"spec": [1, 2]}).encode())
    assert inbox.waiting("mine-20261126-000000-abcd") and not inbox.waiting("../mine")
    entries = {e.path.removeprefix(INBOX): e for e in inbox.entries()}
    mine = entries["mine-20261126-000000-abcd.json"]
    assert (mine.job_id, mine.spec, mine.priority, mine.error) == ("mine-20261126-000000-abcd", spec, "interactive", None)
    assert entries["not a job id.json"].job_id is None and "not a job id" in entries["not a job id.json"].error
    assert entries["big-1.json"].spec is None and "over the" in entries["big-1.json"].error
    assert entries["junk-1.json"].spec is None and "not a job the farm client wrote" in entries["junk-1.json"].error
    for entry in entries.values():
        inbox.done(entry)
    assert inbox.entries() == [] and not inbox.waiting("mine-20261126-000000-abcd")
    with pytest.raises(ValueError, match="not a job id"):
        inbox.post("../escape", spec, None)


def test_a_cancel_goes_in_with_the_jobs_and_its_answer_comes_back_once(store):
    """`farm cancel --store`: the request is listed with the inbox's jobs (one listing), a name that
    is no job id is refused, and the service's answer is read back once."""
    inbox = ServiceInbox(store)
    inbox.post("mine-20261126-000000-abcd", {"graphs": ["blob://sha256/" + "0" * 64], "targets": ["core-aten"]}, None)
    inbox.post_cancel("mine-20261126-000000-abcd")
    store.backend.write(f"{CANCELS}no job here.json", b"{}")
    entries = {e.path.removeprefix(INBOX): e for e in inbox.entries()}
    assert not entries["mine-20261126-000000-abcd.json"].cancel
    cancel = entries["cancel/mine-20261126-000000-abcd.json"]
    assert (cancel.cancel, cancel.job_id, cancel.spec) == (True, "mine-20261126-000000-abcd", None)
    foreign = entries["cancel/no job here.json"]
    assert foreign.cancel and foreign.job_id is None and "not a job id" in foreign.error
    assert inbox.answer("mine-20261126-000000-abcd") is None
    inbox.answer_cancel("mine-20261126-000000-abcd", {"job_id": "mine-20261126-000000-abcd", "units_stopped": 2})
    assert inbox.answer("mine-20261126-000000-abcd") == {"job_id": "mine-20261126-000000-abcd", "units_stopped": 2}
    assert inbox.answer("mine-20261126-000000-abcd") is None  # read once
    store.backend.write(f"{ANSWERS}cancel-other-1.json", b"not json")
    assert "not one it writes" in inbox.answer("other-1")["error"]
    with pytest.raises(ValueError, match="not a job id"):
        inbox.post_cancel("../escape")


def test_an_answer_no_client_read_goes_once_it_is_old(store):
    """A client that died (or gave up) leaves its answer unread: the service's next answers remove
    it once an hour has passed, by the store's own clock, and never a fresh one."""
    inbox = ServiceInbox(store)
    inbox.answer_cancel("gone-20261126-000000-abcd", {"units_stopped": 1})
    time.sleep(1.1)  # mtimes of S3 listings are whole seconds
    inbox.answer_cancel("late-20261126-000000-abcd", {"units_stopped": 0})
    assert len(list(store.backend.list(ANSWERS))) == 2  # neither is old
    inbox.prune_answers(older_than_s=0.5)
    assert list(store.backend.list(ANSWERS)) == [f"{ANSWERS}cancel-late-20261126-000000-abcd.json"]
    assert inbox.answer("late-20261126-000000-abcd") == {"units_stopped": 0}


def test_the_heartbeat_says_whether_a_service_watches_the_store(store):
    inbox = ServiceInbox(store)
    assert inbox.alive() is None
    inbox.beat({"store": store.uri, "pid": 1})
    assert inbox.alive()["store"] == store.uri
    store.backend.write(ALIVE, json.dumps({"store": store.uri, "beat_at": time.time() - 60}).encode())
    assert inbox.alive() is None and inbox.last_beat() is not None  # a service that stopped beating
    inbox.stop_beating()
    assert inbox.alive() is None and inbox.last_beat() is None


def test_a_job_waiting_in_the_inbox_is_found_by_its_id(tmp_path):
    """`farm submit --detach` prints the id before the service takes the job: `farm status ID`
    (client.job) finds it there, queued, and says when no service watches the store."""
    from farm.client import UnknownJob, job

    store = store_from_uri(str(tmp_path / "store"))
    job_id = "mine-20261126-000000-abcd"
    ServiceInbox(store).post(job_id, {"graphs": ["blob://sha256/" + "a" * 64], "targets": ["core-aten"]}, None)
    doc = job(job_id, store).status()
    assert doc["state"] == "queued" and "no farm service watches" in doc["error"]
    with pytest.raises(UnknownJob, match="no job"):
        job("../mine-20261126-000000-abcd", store)  # only ids of the inbox's own shape are looked up there
