"""The vLLM plugin's own logic, without vLLM: the version gate and the audio token it reads from configs."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engines" / "vllm_plugin"))
import tapdraft_vllm  # noqa: E402


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5", "0.32.0rc1"])
def test_versions_it_was_proven_on_are_accepted(version):
    tapdraft_vllm.check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0"])
def test_other_versions_are_refused_in_one_line(version):
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x .* found " + version.replace(".", r"\.")) as e:
        tapdraft_vllm.check_version(version)
    assert "\n" not in str(e.value)


def test_audio_token_from_the_config_or_its_thinker():
    assert tapdraft_vllm.audio_token_id(SimpleNamespace(audio_token_index=7)) == 7
    assert tapdraft_vllm.audio_token_id(SimpleNamespace(audio_token_id=9)) == 9
    assert tapdraft_vllm.audio_token_id(SimpleNamespace(thinker_config=SimpleNamespace(audio_token_id=3))) == 3
    assert tapdraft_vllm.audio_token_id(SimpleNamespace(vocab_size=5)) is None


class _Config(SimpleNamespace):
    def update(self, values):
        self.__dict__.update(values)


def test_mtp_exports_are_routed_to_the_plugins_class_and_others_to_vllms_override(monkeypatch):
    """An export naming TapdraftMTPForCausalLM becomes a generic MTP draft (a model type vLLM's MTP path accepts)
    with one predicted layer per physical layer; any other config is left to vLLM's own override."""
    ours = _Config(architectures=[tapdraft_vllm.MTP_ARCHITECTURE], model_type="qwen3", num_nextn_predict_layers=1)
    seen = []
    monkeypatch.setattr(tapdraft_vllm, "_OVERRIDE", [lambda c: seen.append(c) or c])
    assert tapdraft_vllm.mtp_config_override(ours) is ours and not seen
    assert (ours.model_type, ours.n_predict) == ("mtp", 1)
    other = _Config(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next")
    assert tapdraft_vllm.mtp_config_override(other) is other and seen == [other] and other.model_type == "qwen3_next"


def test_dflash2_walk_follows_the_index_chosen_before_it():
    """The selector's greedy walk (vLLM's ``_selector_walk_kernel`` at T = 0): slot 0 reads predecessor row 0, each
    later slot the row of the candidate index chosen before it, so it drafts a path that per-slot argmaxes miss;
    equal maxima go to the first index."""
    import torch

    from tapdraft_vllm.candidate_heads import walk

    cand = torch.tensor([[[10, 11], [20, 21], [30, 31]], [[40, 41], [50, 51], [60, 61]]])  # [R=2, K=3, k=2]
    s = torch.zeros(2, 3, 2, 2)  # [R, K, predecessor, candidate]
    s[0, 0] = torch.tensor([[0.0, 1.0], [9.0, 0.0]])  # row 1 never read at slot 0
    s[0, 1] = torch.tensor([[0.0, 7.0], [2.0, 0.0]])  # after index 1: index 0
    s[0, 2] = torch.tensor([[0.0, 5.0], [3.0, 0.0]])  # after index 0: index 1
    s[1, :, :, :] = 4.0  # all equal: the first index each slot
    assert walk(cand, s).tolist() == [[11, 20, 31], [40, 50, 60]]
    greedy_rows = s[0].amax(dim=1).argmax(dim=-1)  # the best candidate of each slot over any predecessor
    assert cand[0].gather(1, greedy_rows[:, None]).flatten().tolist() != [11, 20, 31]
