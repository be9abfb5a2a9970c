"""A served job's files: each call gets its own WORK/vllm-N.*, so two benchmarks serving into one directory at once
cannot overwrite each other's job, output or log."""

from __future__ import annotations

import json

from tapdraft.engines.serving import claim_job_file


def test_a_claim_never_takes_a_number_already_written(tmp_path):
    # the count of vllm-*.json (two files) points at vllm-2.json, which another job already holds
    (tmp_path / "vllm-0.json").write_text("{}")
    (tmp_path / "vllm-2.json").write_text('{"other": true}')
    path = claim_job_file(tmp_path, {"mine": 1})
    assert path.name == "vllm-3.json"
    assert json.loads((tmp_path / "vllm-2.json").read_text()) == {"other": True}
    assert json.loads(path.read_text()) == {"mine": 1}
