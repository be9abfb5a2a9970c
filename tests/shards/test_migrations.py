"""Named migrations: older manifests' and capture records' keys read as today's."""

import json

import pytest

from tapdraft.shards.manifest import migrate_manifest, responses_from_target
from tapdraft.shards.schema import check_schema_version


@pytest.mark.parametrize("doc, want", [
    ({"extra": {"responses_from_target": True}}, True),
    ({"extra": {"regenerated": False}}, False),
    ({"capture_config": {"regenerate": True}}, True),
    ({"extra": {"responses_from_target": None}, "capture_config": {"responses_from_target": False}}, False),
    ({"extra": {"regenerated": True}, "capture_config": {"responses_from_target": False}}, True),  # extra first
    ({"capture_config": {}}, None),
    ({}, None),
])
def test_responses_key_aliases(doc, want):
    before = json.dumps(doc, sort_keys=True)
    assert responses_from_target(doc) is want
    migrated = migrate_manifest(doc)
    assert migrated["extra"].get("responses_from_target") is want
    assert json.dumps(doc, sort_keys=True) == before  # the input is not changed
    assert migrate_manifest(migrated) == migrated  # idempotent


def test_schema_major_check_is_shared():
    check_schema_version("1.7", "x")
    check_schema_version("2.0", "x")
    for bad in ("3.0", "0.9", None, ""):
        with pytest.raises(ValueError, match="unknown major"):
            check_schema_version(bad, "x")
