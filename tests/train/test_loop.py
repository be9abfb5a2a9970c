"""The training loop: exact resume, bad input refused before any step, eval and export round trips."""

import json
import math

import pytest
import torch

from dflash_fixtures import synthetic_samples, tiny_bundle, tiny_dataset, tiny_layout, write_synthetic_dataset
from tapdraft.common.errors import LockedError
from tapdraft.shards.schema import Layout
from tapdraft.train.checkpoints import latest_checkpoint, load_checkpoint
from tapdraft.train.config import load_run_config
from tapdraft.train.drafters.common.export_files import load_export
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.evaluate import evaluate
from tapdraft.train.export import export_run
from tapdraft.train.loop import train
from tapdraft.train.run import run_lock

FAST = ["max_tokens=160", "max_batch_size=4", "warmup_steps=2", "progress=false", "log_every=1", "lr=3e-3",
        "num_anchors=8", "max_total_anchors=24"]


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("mem"), n=16, min_len=16, max_len=32)


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl")]


def test_resume_continues_exactly(tmp_path, mem):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=6", "ckpt_every=100", "grad_accum=2"])
    train(run, mem.path, tmp_path / "full")
    train(run, mem.path, tmp_path / "cut", stop_at=3)
    assert latest_checkpoint(tmp_path / "cut").name == "step-0000003"
    s = train(run, mem.path, tmp_path / "cut")
    assert s["resumed_from_step"] == 3
    full, cut = _losses(tmp_path / "full"), _losses(tmp_path / "cut")
    assert len(full) == 6 and len(cut) == 6
    assert cut == pytest.approx(full, rel=1e-6, abs=1e-7)
    a = load_checkpoint(latest_checkpoint(tmp_path / "full")).draft
    b = load_checkpoint(latest_checkpoint(tmp_path / "cut")).draft
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_resume_with_loader_workers_continues_exactly(tmp_path, mem):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=4", "ckpt_every=100", "num_workers=2"])
    train(run, mem.path, tmp_path / "full")
    train(run, mem.path, tmp_path / "cut", stop_at=3)
    train(run, mem.path, tmp_path / "cut")
    assert _losses(tmp_path / "cut") == pytest.approx(_losses(tmp_path / "full"), rel=1e-6, abs=1e-7)
    one = load_run_config("dflash_b8", overrides=FAST + ["max_steps=4", "ckpt_every=100"])
    train(one, mem.path, tmp_path / "one")  # a different (1-worker) partition: a different but valid run
    assert len(_losses(tmp_path / "one")) == 4


def test_resume_on_other_bytes_of_the_same_target_is_refused(tmp_path, mem):
    """A checkpoint records its training split's identity (its shards' sha256s): a resume on another dataset of the
    same target (a derive or a recapture at the same path) is refused in one line that says the dataset changed; a
    checkpoint written before the identity was recorded (version 2) still resumes on its own data."""
    import shutil

    from tapdraft.train.checkpoints import STATE_FILE

    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=4", "ckpt_every=100"])
    data = tmp_path / "data"
    shutil.copytree(mem.path, data)
    train(run, data, tmp_path / "r", stop_at=2)
    ck = latest_checkpoint(tmp_path / "r")
    assert load_checkpoint(ck).dataset["shards"] >= 1
    shutil.rmtree(data)
    tiny_dataset(data, n=16, seed=5, min_len=16, max_len=32)  # the same target, other samples
    with pytest.raises(ValueError, match=r"is not the dataset .* was trained on \(split 'train' now holds other "
                                         r"shards"):
        train(run, data, tmp_path / "r")
    shutil.rmtree(data)
    shutil.copytree(mem.path, data)
    state = torch.load(ck / STATE_FILE, weights_only=True)
    del state["dataset"]
    torch.save({**state, "version": 2}, ck / STATE_FILE)  # written before version 3
    assert train(run, data, tmp_path / "r")["resumed_from_step"] == 2


def test_resume_with_another_config_is_refused(tmp_path, mem):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=2"])
    train(run, mem.path, tmp_path / "r")
    other = load_run_config("dflash_b8", overrides=FAST + ["max_steps=4", "lr=1e-2"])
    with pytest.raises(ValueError, match=r"another config \(1 setting\(s\) differ, checkpoint vs now: train.lr: "
                       r"0.003 vs 0.01\); rerun with the recipe and --set values it was started with"):
        train(other, mem.path, tmp_path / "r")
    mtp = load_run_config("mtp", overrides=FAST[:6] + ["max_steps=2"])  # another recipe: a short line, not 25 fields
    with pytest.raises(ValueError, match=r"\(1 setting\(s\) differ, checkpoint vs now: family: dflash vs mtp\)"):
        train(mtp, mem.path, tmp_path / "r")
    many = load_run_config("dflash_b8", overrides=FAST + ["max_steps=2", "lr=1e-2", "seed=3", "beta1=0.8",
                                                          "beta2=0.9", "weight_decay=0.5"])
    with pytest.raises(ValueError, match=r"\(5 setting\(s\) differ, .*; and 1 more\)"):
        train(many, mem.path, tmp_path / "r")
    longer = load_run_config("dflash_b8", overrides=FAST + ["max_steps=3"])  # max_steps may change, said aloud
    with pytest.warns(UserWarning, match="max_steps changed from 2 to 3 on resume from step 2: the learning-rate"):
        assert train(longer, mem.path, tmp_path / "r")["resumed_from_step"] == 2


def test_a_second_training_on_the_same_run_dir_is_refused(tmp_path, mem):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=1"])
    with run_lock(tmp_path / "r", 0):  # another training holds the directory
        with pytest.raises(LockedError, match=r"r is in use by a training \(rank 0\) \(pid \d+ on .*one writer"):
            train(run, mem.path, tmp_path / "r")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    assert train(run, mem.path, tmp_path / "r")["steps"] == 1  # released: the next run proceeds


def test_bad_inputs_refused_before_any_step(tmp_path, mem):
    base = FAST + ["max_steps=1"]
    with pytest.raises(ValueError, match="captured from target"):
        train(load_run_config("dflash_b8", overrides=base + ["fingerprint=abc"]), mem.path, tmp_path / "a")
    with pytest.raises(ValueError, match="did not store"):
        train(load_run_config("dflash_b8", overrides=base + ["target_layer_ids=[0]"]), mem.path, tmp_path / "b")
    narrow = Layout(hidden_size=16, num_layers=4, tap_ids=(1, 3), top_k=8, audio_token_id=3)  # bundle is 32 wide
    wrong_h = tiny_dataset(tmp_path / "wrong_h", [dict(s, taps=s["taps"][..., :16]) for s in mem.samples[:4]],
                           layout=narrow)
    with pytest.raises(ValueError, match="hidden size"):
        train(load_run_config("dflash_b8", overrides=base), wrong_h.path, tmp_path / "c")
    no_topk = Layout(hidden_size=32, num_layers=4, tap_ids=(1, 3), top_k=0, audio_token_id=3)
    unsup = tiny_dataset(tmp_path / "unsup", [
        {k: v for k, v in s.items() if not k.startswith("topk")} | {"loss_mask": torch.zeros_like(s["loss_mask"])}
        for s in mem.samples[:4]], layout=no_topk)
    with pytest.raises(ValueError, match="no supervised tokens"):
        train(load_run_config("dflash_b8", overrides=base), unsup.path, tmp_path / "d")
    for d in "abcd":
        assert not (tmp_path / d / "checkpoints").exists()


def _reference_logits(cfg, w, bundle, taps_TnH, ids_T, anchor):
    """An independent float64 DFlash forward from an export (config.json + safetensors) and the bundle."""
    D = lambda t: t.double()
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, B = cfg["rms_norm_eps"], cfg["block_size"]

    def rms(x, wt):
        return D(wt) * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        f = pos[:, None].double() * inv
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    tap_idx = [cfg["tapdraft_layout_tap_ids"].index(i) for i in cfg["target_layer_ids"]]
    ctx = rms(D(taps_TnH[:anchor, tap_idx]).reshape(anchor, -1) @ D(w["fc.weight"]).T, w["hidden_norm.weight"])
    tok = torch.full((B,), cfg["mask_token_id"])
    tok[0] = ids_T[anchor]
    x = D(bundle.embed_tokens)[tok]
    pos = anchor + torch.arange(B)
    cpos = torch.arange(anchor)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ D(w[p + "self_attn.q_proj.weight"]).T).view(B, nh, hd)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"]).transpose(0, 1), pos)
        kin = torch.cat([ctx, h])
        k = (kin @ D(w[p + "self_attn.k_proj.weight"]).T).view(-1, nkv, hd)
        v = (kin @ D(w[p + "self_attn.v_proj.weight"]).T).view(-1, nkv, hd).transpose(0, 1)
        k = rope(rms(k, w[p + "self_attn.k_norm.weight"]).transpose(0, 1), torch.cat([cpos, pos]))
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), -1) @ v
        x = x + att.transpose(0, 1).reshape(B, nh * hd) @ D(w[p + "self_attn.o_proj.weight"]).T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = h @ D(w[p + "mlp.gate_proj.weight"]).T
        up = h @ D(w[p + "mlp.up_proj.weight"]).T
        x = x + (torch.nn.functional.silu(g) * up) @ D(w[p + "mlp.down_proj.weight"]).T
    return rms(x, w["norm.weight"]) @ D(bundle.lm_head).T / cfg["logits_scaling"]


def test_eval_and_export_round_trip(tmp_path, mem):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=3", "num_layers=2"])
    train(run, mem.path, tmp_path / "run")
    res = evaluate(tmp_path / "run", mem.path, out_dir=tmp_path / "ev")
    assert (tmp_path / "ev" / "eval.json").is_file() and (tmp_path / "ev" / "acceptance.png").stat().st_size > 1000
    assert len(res["alpha"]) == 7 and 1.0 <= res["tau"] <= 8.0 and "not record" in res["note"]
    summary = export_run(tmp_path / "run", tmp_path / "exp")
    cfg, w = load_export(tmp_path / "exp")
    assert summary["target_layer_ids_vllm"] == [i + 1 for i in cfg["target_layer_ids"]]
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["mask_token_id"] == cfg["mask_token_id"]
    assert cfg["target_head"] == mem.bundle.head.to_dict()  # serving applies the target's head as training did
    assert not any(k.startswith(("embed", "lm_head")) for k in w)
    exported = " ".join(p.read_text() for p in (tmp_path / "exp").glob("*.json"))
    assert str(tmp_path) not in exported  # an export travels: no local absolute path in it
    ck = latest_checkpoint(tmp_path / "run")
    assert cfg["tapdraft"]["source_checkpoint"] == ck.relative_to(tmp_path / "run").as_posix()
    cfg["tapdraft_layout_tap_ids"] = list(mem.layout.tap_ids)
    # the trainer's drafter with the checkpoint weights vs the independent reference on the export
    model = DFlashDrafter.build(run.drafter, mem.bundle, mem.layout)
    model.load_state_dict(load_checkpoint(latest_checkpoint(tmp_path / "run")).draft)
    s = mem.samples[0]
    anchor = int(torch.nonzero(s["loss_mask"])[0]) + 2
    from tapdraft.train.data import collate

    batch = collate([s])
    with torch.no_grad():
        h = model.block_hidden(batch["input_ids"], model.context(batch["taps"]), torch.tensor([[anchor]]))
        got = model.logits(h[0, 0])
    ref = _reference_logits(cfg, w, mem.bundle, s["taps"], s["input_ids"].long(), anchor)
    assert torch.allclose(got.double(), ref, atol=1e-4, rtol=1e-4)


def test_dataset_path_end_to_end_and_eval_split(tmp_path):
    bundle = tiny_bundle(tmp_path / "ds")
    layout = tiny_layout(bundle)
    samples = synthetic_samples(bundle, layout, 12, min_len=16, max_len=32)
    path = write_synthetic_dataset(tmp_path / "ds", bundle, layout,
                                   {"train": samples[:8], "validation": samples[8:]}, regenerated=True)
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=2"])
    s = train(run, path, tmp_path / "run")
    assert s["steps"] == 2 and math.isfinite(s["final_loss"])
    res = evaluate(tmp_path / "run", path)
    assert res["split"] == "validation" and res["samples"] == 4 and "exact for greedy" in res["note"]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["train"]["max_steps"] == 2 and saved["family"] == "dflash"


@pytest.mark.slow
@pytest.mark.integration
def test_loss_falls_and_acceptance_rises(tmp_path):
    bundle = tiny_bundle(tmp_path / "ds")
    layout = tiny_layout(bundle)
    samples = synthetic_samples(bundle, layout, 48, min_len=20, max_len=40, seed=1)
    path = write_synthetic_dataset(tmp_path / "ds", bundle, layout, {"train": samples[:40], "validation": samples[40:]})
    run = load_run_config("dflash_b8", overrides=["max_steps=200", "max_tokens=320", "max_batch_size=8",
                                                  "warmup_steps=10", "lr=5e-3", "progress=false", "log_every=20",
                                                  "ckpt_every=1000"])
    train(run, path, tmp_path / "r0", stop_at=1)
    tau0 = evaluate(tmp_path / "r0", path, plot=False)["tau"]
    train(run, path, tmp_path / "run")
    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert lines[-1]["loss"] < 0.7 * lines[0]["loss"]
    assert lines[-1]["tau"] > lines[0]["tau"]
    tau = evaluate(tmp_path / "run", path, plot=False)["tau"]
    assert tau > tau0 + 0.3, (tau0, tau)


def test_head_dtype_sets_the_vocabulary_matmuls(tmp_path, mem):
    from tapdraft.train.loop import head_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (head_dtype(cpu, "auto"), head_dtype(cuda, "auto")) == (torch.float32, torch.bfloat16)
    assert (head_dtype(cpu, "bfloat16"), head_dtype(cuda, "float32")) == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="head_dtype"):
        load_run_config("dflash_b8", overrides=["head_dtype=fp16"])
    train(load_run_config("dflash_b8", overrides=FAST + ["max_steps=3"]), mem.path, tmp_path / "fp32")
    bf16 = load_run_config("dflash_b8", overrides=FAST + ["max_steps=3", "head_dtype=bfloat16"])
    train(bf16, mem.path, tmp_path / "bf16")
    a, b = _losses(tmp_path / "fp32"), _losses(tmp_path / "bf16")
    assert a != b and b == pytest.approx(a, rel=2e-2)  # the same run up to bf16 rounding of the head
