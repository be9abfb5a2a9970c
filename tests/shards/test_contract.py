"""The dataset contract: tap numbering, the sample schema check, the target bundle and its fingerprint."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tapdraft.shards.bundle import (CONFIG_KEYS, bundle_fingerprint, compute_fingerprint, load_bundle, migrate_bundle_doc,
                           write_bundle)
from tapdraft.shards.head import HeadSpec
from tapdraft.shards.schema import Layout, teacher_rows, validate_sample
from tapdraft.shards.taps import capture_tap_ids, default_tap_ids, from_vllm, to_vllm


def test_default_taps_follow_the_dflash_rule():
    assert default_tap_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_tap_ids(36, 1) == [18]
    assert default_tap_ids(6, 2) == [1, 3]
    for L in range(1, 12):  # shallow targets still get distinct, in-range layers
        for n in range(1, 8):
            ids = default_tap_ids(L, n)
            assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < L and len(ids) == min(n, L)
    assert capture_tap_ids(36, 5) == [1, 9, 17, 18, 25, 33, 35]  # + the one-layer draft's middle tap
    assert from_vllm(to_vllm([1, 9, 35])) == [1, 9, 35]
    assert to_vllm([0, 35]) == [1, 36]
    with pytest.raises(ValueError):
        default_tap_ids(0, 2)


def _layout(**kw):
    base = dict(hidden_size=8, num_layers=4, tap_ids=(1, 3), top_k=3, audio_token_id=99)
    base.update(kw)
    return Layout(**base)


def _sample(T=6, layout=None):
    layout = layout or _layout()
    loss_mask = torch.tensor([0, 0, 1, 1, 0, 1][:T], dtype=torch.bool)
    rows = teacher_rows(loss_mask)
    return {
        "sample_id": "s0",
        "source": "unit",
        "audio_seconds": 0.0,
        "input_ids": torch.arange(T, dtype=torch.int32),
        "is_audio": torch.zeros(T, dtype=torch.bool),
        "loss_mask": loss_mask,
        "taps": torch.randn(T, layout.n_taps, layout.hidden_size).bfloat16(),
        "topk_rows": rows,
        "topk_ids": torch.zeros(len(rows), layout.top_k, dtype=torch.int32),
        "topk_logprobs": torch.full((len(rows), layout.top_k), -2.0),
    }


def test_teacher_rows_are_rows_whose_next_token_is_supervised():
    mask = torch.tensor([0, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert teacher_rows(mask).tolist() == [1, 2, 4]


def test_layout_rejects_bad_taps_and_round_trips():
    with pytest.raises(ValueError, match="tap_ids"):
        _layout(tap_ids=(3, 1))
    with pytest.raises(ValueError, match="tap_ids"):
        _layout(tap_ids=(4,))
    with pytest.raises(ValueError, match="taps_codec"):
        _layout(taps_codec="int4")
    lay = _layout()
    assert Layout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    assert lay.last_layer_tap == 1 and lay.vllm_tap_ids == [2, 4]


def test_validate_accepts_a_good_sample():
    validate_sample(_sample(), _layout())


@pytest.mark.parametrize(
    "field,bad,message",
    [
        ("taps", lambda s: s["taps"].float(), "dtype"),
        ("taps", lambda s: s["taps"][:, :1], "shape"),
        ("input_ids", lambda s: s["input_ids"].long(), "dtype"),
        ("topk_logprobs", lambda s: s["topk_logprobs"].fill_(float("nan")), "NaN"),
        ("taps", lambda s: s["taps"].fill_(float("inf")), "NaN or Inf"),
        ("topk_rows", lambda s: s["topk_rows"][:-1], "shape|topk_rows"),
    ],
)
def test_validate_names_the_field_that_is_wrong(field, bad, message):
    s = _sample()
    s[field] = bad(s)
    with pytest.raises(ValueError, match=message) as err:
        validate_sample(s, _layout())
    assert "'s0'" in str(err.value)


def test_validate_rejects_missing_and_unknown_fields():
    s = _sample()
    del s["loss_mask"]
    with pytest.raises(ValueError, match="loss_mask"):
        validate_sample(s, _layout())
    s = _sample()
    s["final_hidden"] = torch.zeros(6, 8).bfloat16()
    with pytest.raises(ValueError, match="not in the schema"):
        validate_sample(s, _layout())


def _bundle_args(tmp_path, seed=0):
    g = torch.Generator().manual_seed(seed)
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer.json").write_text('{"model": "toy"}')
    config = {k: None for k in CONFIG_KEYS} | {"hidden_size": 8, "num_hidden_layers": 4, "vocab_size": 16}
    return dict(
        config=config,
        audio={"sample_rate": 16000, "frame_seconds": 0.08},
        chat_template="{{ messages }}",
        embed_tokens=torch.randn(16, 8, generator=g),
        norm_weight=torch.ones(8),
        lm_head=torch.randn(16, 8, generator=g),
        tokenizer_dir=tok,
    )


def test_bundle_round_trip_and_deterministic_fingerprint(tmp_path):
    args = _bundle_args(tmp_path)
    fp1 = write_bundle(tmp_path / "a", **args)
    fp2 = write_bundle(tmp_path / "b", **args)
    assert fp1 == fp2 and len(fp1) == 64
    assert bundle_fingerprint(**args) == fp1
    b = load_bundle(tmp_path / "a")
    assert b.fingerprint == fp1 and b.hidden_size == 8 and b.vocab_size == 16
    assert torch.equal(b.lm_head, args["lm_head"]) and b.tokenizer_files["tokenizer.json"] == b'{"model": "toy"}'
    other = _bundle_args(tmp_path, seed=1)
    assert write_bundle(tmp_path / "c", **other) != fp1
    args["chat_template"] = "{{ other }}"
    assert write_bundle(tmp_path / "d", **args) != fp1


def test_template_kwargs_are_in_the_bundle_and_its_fingerprint(tmp_path):
    args = _bundle_args(tmp_path)
    plain = write_bundle(tmp_path / "a", **args)
    thinking_off = write_bundle(tmp_path / "b", **args, template_kwargs={"enable_thinking": False})
    assert thinking_off != plain
    assert write_bundle(tmp_path / "c", **args, template_kwargs={"enable_thinking": True}) not in (plain, thinking_off)
    b = load_bundle(tmp_path / "b")
    assert b.template_settings == ("{{ messages }}", {"enable_thinking": False})
    assert bundle_fingerprint(**args, template_kwargs={"enable_thinking": False}) == thinking_off
    # a bundle written before kwargs were recorded (no key in bundle.json) keeps its fingerprint
    meta = tmp_path / "a" / "bundle.json"
    doc = json.loads(meta.read_text())
    assert doc.pop("template_kwargs") == {}
    meta.write_text(json.dumps(doc))
    old = load_bundle(tmp_path / "a")
    assert old.fingerprint == plain and old.template_kwargs == {}
    # editing the recorded kwargs is caught like any other edit
    doc = json.loads((tmp_path / "b" / "bundle.json").read_text())
    doc["template_kwargs"] = {"enable_thinking": True}
    (tmp_path / "b" / "bundle.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="corrupted or was edited"):
        load_bundle(tmp_path / "b")


def test_bundle_detects_tampering_and_missing_dirs(tmp_path):
    write_bundle(tmp_path / "a", **_bundle_args(tmp_path))
    tok = tmp_path / "a" / "tokenizer" / "tokenizer.json"
    tok.write_text('{"model": "tay"}')  # same size: only a re-hash sees it
    load_bundle(tmp_path / "a")  # opening hashes no file: it checks sizes and bundle.json against its fingerprint
    with pytest.raises(ValueError, match="corrupted or was edited"):
        load_bundle(tmp_path / "a", verify=True)
    tok.write_text('{"model": "edited"}')
    with pytest.raises(ValueError, match="corrupted or was edited"):
        load_bundle(tmp_path / "a")
    write_bundle(tmp_path / "b", **_bundle_args(tmp_path))
    meta = tmp_path / "b" / "bundle.json"
    doc = json.loads(meta.read_text())
    doc["head"]["eps"] = 1e-5  # a head edited by hand would make the teacher silently different
    meta.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="corrupted or was edited"):
        load_bundle(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="not a tapdraft target bundle"):
        load_bundle(tmp_path / "nowhere")


def test_tied_head_is_stored_once_and_read_as_the_embedding(tmp_path):
    args = _bundle_args(tmp_path)
    args["lm_head"] = args["embed_tokens"]  # the same tensor, as a tied model holds it
    args["head"] = HeadSpec(tied=True)
    fp = write_bundle(tmp_path / "a", **args)
    assert not (tmp_path / "a.tmp").exists()
    b = load_bundle(tmp_path / "a", verify=True)
    assert b.fingerprint == fp and b.head.tied and b.lm_head is b.embed_tokens
    assert torch.equal(b.lm_head, args["embed_tokens"])
    stored = safe_open(str(tmp_path / "a" / "weights.safetensors"), "pt").keys()
    assert sorted(stored) == ["embed_tokens", "norm_weight"]
    args["lm_head"] = args["embed_tokens"] + 1
    with pytest.raises(ValueError, match="tied"):
        write_bundle(tmp_path / "b", **args)


def test_bundle_keeps_only_allow_listed_tokenizer_files_in_the_given_dtype(tmp_path):
    args = _bundle_args(tmp_path)
    for name in ("model.safetensors", "config.json", "pytorch_model.bin", "chat_template.jinja",
                 "special_tokens_map.json"):
        (args["tokenizer_dir"] / name).write_text("x")
    write_bundle(tmp_path / "a", **args, dtype=torch.bfloat16)
    b = load_bundle(tmp_path / "a")
    assert sorted(b.tokenizer_files) == ["chat_template.jinja", "special_tokens_map.json", "tokenizer.json"]
    assert b.embed_tokens.dtype == b.lm_head.dtype == b.norm_weight.dtype == torch.bfloat16


def test_bundle_before_head_specs_reads_through_the_named_migration(tmp_path):
    """A schema-1.0 bundle (no head, lm_head always stored, fingerprint without a head) still opens."""
    args = _bundle_args(tmp_path)
    weights = {n: args[n] for n in ("embed_tokens", "norm_weight", "lm_head")}
    args["config"]["rms_norm_eps"], args["config"]["logits_scaling"] = 1e-5, 2.0
    root = tmp_path / "old"
    (root / "tokenizer").mkdir(parents=True)
    save_file(weights, str(root / "weights.safetensors"))
    (root / "tokenizer" / "tokenizer.json").write_text('{"model": "toy"}')
    fp = compute_fingerprint(args["config"], args["audio"], args["chat_template"], weights,
                             {"tokenizer.json": b'{"model": "toy"}'})
    doc = {"config": {k: args["config"].get(k) for k in CONFIG_KEYS}, "audio": args["audio"],
           "chat_template": args["chat_template"], "fingerprint": fp}
    (root / "bundle.json").write_text(json.dumps(doc))
    assert migrate_bundle_doc(doc)["head"] == HeadSpec(eps=1e-5, logits_scaling=2.0).to_dict()
    assert "head" not in doc  # the input is not changed
    b = load_bundle(root, verify=True)
    assert b.fingerprint == fp and b.head == HeadSpec(eps=1e-5, logits_scaling=2.0)
    assert torch.equal(b.lm_head, args["lm_head"])


def test_bundle_rejects_inconsistent_weights(tmp_path):
    args = _bundle_args(tmp_path)
    args["norm_weight"] = torch.ones(7)
    with pytest.raises(ValueError, match="disagree"):
        write_bundle(tmp_path / "a", **args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_reads_exponent_bits_like_isfinite(dtype):
    from tapdraft.shards.schema import all_finite

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * 1e3).to(dtype)
    assert all_finite(x) and all_finite(x[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in (0, 1234, 4095):
            y = x.clone()
            y[pos] = bad
            assert all_finite(y) == bool(torch.isfinite(y).all()) is False
    big = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max, torch.finfo(dtype).tiny, 0.0], dtype=dtype)
    assert all_finite(big)
    assert all_finite(x.view(64, 64).t())  # non-contiguous input
