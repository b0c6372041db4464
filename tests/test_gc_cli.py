"""A bounded store from a user's side: a unit whose artifact was deleted is compiled again (never a
hit on a missing artifact), and `farm pin`, `farm pins`, `farm du`, `farm gc`, `farm unpin` on a
store that real jobs compiled into."""
from __future__ import annotations

import json

import pytest

from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri
from storage.store import blob_path
from tests.cli import farm

pytestmark = pytest.mark.slow


def test_a_unit_whose_artifact_was_deleted_is_compiled_again_not_a_hit(zoo_dir, tmp_path):
    store = store_from_uri(str(tmp_path / "store"))
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["core-aten"]})
    (first,) = execute(job, store).results
    assert first.status == "compiled", first.error
    store.backend.delete(blob_path(first.artifact.digest))  # a person, a lifecycle rule, a collector
    (again,) = execute(job, store).results
    assert again.status == "compiled", again.error
    assert "compiled again" in again.note and "artifact" in again.note
    manifest, incomplete = store.complete_manifest(first.key)
    assert incomplete is None and manifest["blobs"]["artifact"]["digest"] == again.artifact.digest
    assert store.has_blob(again.artifact)
    (third,) = execute(job, store).results
    assert third.status == "hit" and third.artifact == again.artifact


def test_pin_du_and_gc_from_the_command_line(zoo_dir, tmp_path):
    d = str(tmp_path / "store")
    store = store_from_uri(d)
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2"), str(zoo_dir / "cnn.pt2")], "targets": ["core-aten"]})
    outcome = execute(job, store)
    keys = {r.graph: r.key for r in outcome.results}
    assert {r.status for r in outcome.results} == {"compiled"}

    assert "pinned 1 unit(s) as release-1" in farm("pin", keys["mlp"][:12], "--label", "release-1", "--store", d)
    assert "name a unit KEY, --job JOB or --remote-cache KIND" in farm("pin", "--store", d)
    listed = json.loads(farm("pins", "--json", "--store", d))
    assert [(p["name"], p["keys"]) for p in listed] == [("release-1", [keys["mlp"]])]

    du = json.loads(farm("du", "--json", "--store", d))
    assert du["by_kind"]["manifests"]["count"] == 2 and du["by_kind"]["programs"]["count"] == 2
    assert du["by_kind"]["artifacts"]["count"] == 2 and du["by_kind"]["logs"]["count"] == 2
    assert du["by_target"]["core-aten"]["count"] == 2 and du["by_last_use"]["< 1 day"]["count"] == 2
    assert du["gc_unused_days_frees_bytes"]["1"] == 0 and du["pinned_units"] == 1
    assert du["bytes"] == sum(i.size for i in store.backend.list_info(""))
    assert "units by target" in farm("du", "--store", d)

    young = farm("gc", "--unused-days", "0", "--dry-run", "--store", d)  # the unpinned unit's blobs are a day young
    assert "are named by nothing, but younger than --grace-s 86400 (a publish may be in flight)" in young
    dry = json.loads(farm("gc", "--unused-days", "0", "--grace-s", "0", "--dry-run", "--json", "--store", d))
    assert dry["dry_run"] and dry["deleted"]["units"]["count"] == 1 and len(list(store.manifest_keys())) == 2
    done = json.loads(farm("gc", "--unused-days", "0", "--grace-s", "0", "--json", "--store", d))
    assert done["deleted"] == dry["deleted"]
    assert list(store.manifest_keys()) == [keys["mlp"]]  # the pinned one stays, and everything it needs
    fetched = json.loads(farm("fetch", keys["mlp"], str(tmp_path / "mlp.pt2"), "--json", "--store", d))
    assert (tmp_path / "mlp.pt2").stat().st_size == fetched["bytes"]
    (tmp_path / "into").mkdir()  # a directory: the artifact goes in under its usual name, as cp would put it
    into = json.loads(farm("fetch", keys["mlp"], str(tmp_path / "into"), "--json", "--store", d))
    assert into["path"] == str(tmp_path / "into" / "model.pt2") and (tmp_path / "into" / "model.pt2").is_file()
    (tmp_path / "a-file").write_text("")
    said = farm("fetch", keys["mlp"], str(tmp_path / "a-file" / "m.pt2"), "--store", d)
    assert f"cannot write {tmp_path / 'a-file' / 'm.pt2'}: " in said and "Traceback" not in said, said
    assert "error" in farm("fetch", keys["cnn"], str(tmp_path / "cnn.pt2"), "--store", d)

    assert "unpinned release-1" in farm("unpin", "release-1", "--store", d)
    assert "no pin named release-1" in farm("unpin", "release-1", "--store", d)
    table = farm("gc", "--unused-days", "0", "--grace-s", "0", "--store", d)
    assert "deleted from" in table and "units" in table
    assert list(store.manifest_keys()) == [] and list(store.backend.list("blobs/")) == []
    assert "grace_s must be a number >= 0" in farm("gc", "--grace-s", "-1", "--store", d)
