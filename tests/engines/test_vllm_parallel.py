"""``capture --engine vllm`` with parallel sizes > 1: the size-1 dataset, or one error line before anything runs.

The BPE target's first 8 training conversations are captured by vLLM (fp32, CPU backend) with
tensor_parallel_size 1 and 2 and with data_parallel_size 2, and compared with the checks of the
equivalence test (tests/engines/test_vllm_capture.py): sample ids, input ids, masks and teacher rows equal;
taps within one bf16 step; teacher top-k ids equal except near-ties; log-probs within ``LP_TOL``.

- TP 2: vLLM's multiprocessing executor runs two CPU workers (vllm/config/parallel.py picks "mp" for a world
  size > 1); every tensor rank holds the whole residual stream after the all-reduce, and only tensor rank 0
  sends (``TapConnector``). The all-reduce sums in another order, so a few taps round to the next bf16 step.
- DP 2: two independent engines, each with half of every window (``VLLMEngine.states``).
- PP 2 is refused by vLLM 0.32 itself (``capture.vllm.engine.check_layout`` says where); tapdraft refuses it
  first, in one line, and a test checks that this vLLM still refuses it, so a new pin that lifts the limit
  shows up here.

Three vLLM start-ups (size 1 ~15 s, TP 2 ~50 s, DP 2 ~25 s on a loaded 2-core machine) dominate the runtime.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from tests.engines.test_vllm_capture import compare, samples

pytestmark = [pytest.mark.engine, pytest.mark.slow]

N = 8


def _capture(bpe_target, vllm_venv, out, **layout):
    from tapdraft.capture.config import CaptureConfig, VLLMConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.shards.shard_file import ShardConfig

    return capture(CaptureConfig(
        target=str(bpe_target.target), out=str(out), data=(("train", str(bpe_target.train_manifest)),),
        max_samples=N, top_k=8, window=4, batch_tokens=512, progress=False, shard=ShardConfig(shard_bytes=30_000),
        engine="vllm", vllm_python=str(vllm_venv / "bin" / "python"), vllm=VLLMConfig(**layout)))


@pytest.fixture(scope="module")
def size1(bpe_target, vllm_venv, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-size1") / "ds"
    return _capture(bpe_target, vllm_venv, out), samples(out)


def _assert_same_dataset(ref, got, what: str) -> None:
    (m0, a), (m1, b) = ref, got
    assert m1["complete"] and m1["fingerprint"] == m0["fingerprint"] and m1["layout"] == m0["layout"]
    assert len(a) == len(b) == N
    compare(a, b, f"train, {what} vs size 1")


def test_tensor_parallel_2_captures_the_size_1_dataset(bpe_target, vllm_venv, size1, tmp_path):
    m = _capture(bpe_target, vllm_venv, tmp_path / "tp2", tensor_parallel_size=2)
    assert m["capture_config"]["vllm"]["tensor_parallel_size"] == 2
    _assert_same_dataset(size1, (m, samples(tmp_path / "tp2")), "TP 2")


def test_data_parallel_2_captures_the_size_1_dataset(bpe_target, vllm_venv, size1, tmp_path):
    m = _capture(bpe_target, vllm_venv, tmp_path / "dp2", data_parallel_size=2)
    _assert_same_dataset(size1, (m, samples(tmp_path / "dp2")), "DP 2")


def test_pipeline_parallel_is_one_line_before_anything_is_written(bpe_target, vllm_venv, tmp_path, capsys):
    from tests.test_cli import assert_one_line, run

    out = tmp_path / "ds"
    code, err = run(["capture", "--target", bpe_target.target, "--data", bpe_target.train_manifest, "--out", out,
                     "--engine", "vllm", "--vllm-python", vllm_venv / "bin" / "python",
                     "--pipeline-parallel-size", "2"], capsys)
    assert_one_line(code, err, contains="cannot extract hidden states with pipeline parallelism")
    assert not (out / "target").exists() and not (out / "manifest.json").exists()


def test_this_vllm_still_refuses_pipeline_parallel_extraction(bpe_target, vllm_venv):
    """The fact check_layout rests on: vLLM's own config check, without starting an engine (~15 s of imports)."""
    from tapdraft.capture.vllm.engine import PP_REFUSED_THROUGH, _engine_env, _release

    script = textwrap.dedent(f"""
        import json, vllm
        from vllm.engine.arg_utils import EngineArgs
        args = EngineArgs(model={str(bpe_target.target)!r}, dtype="float32", enforce_eager=True, max_model_len=512,
                          pipeline_parallel_size=2, enable_prefix_caching=False,
                          speculative_config={{"method": "extract_hidden_states", "num_speculative_tokens": 1,
                              "draft_model_config": {{"hf_config": {{"eagle_aux_hidden_state_layer_ids": [1, 2]}}}}}})
        try:
            args.create_engine_config()
            err = None
        except Exception as e:
            err = f"{{type(e).__name__}}: {{e}}"
        print(json.dumps({{"version": vllm.__version__, "error": err}}))
    """)
    res = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", script], capture_output=True, text=True,
                         env=_engine_env({"VLLM_CPU_KVCACHE_SPACE": "1"}, None), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert _release(got["version"]) <= PP_REFUSED_THROUGH, f"vLLM {got['version']}: revisit check_layout"
    assert got["error"] is not None and "SupportsPP" in got["error"], got
