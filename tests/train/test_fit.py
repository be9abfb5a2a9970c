"""train.fit: the loss-row and token budgets a null setting gets on each device, from the shapes alone."""

import dataclasses

import pytest
import torch

from tests.train.test_mtp import tiny_bundle
from tapdraft.train.config import load_run_config
from tapdraft.train.drafters.dflash.config import UNFITTED_LOSS_ROWS, DFlashConfig
from tapdraft.train.fit import DEFAULT_TOKENS, DRAFT_GFLOP, LOSS_GFLOP, MIN_LOSS_ROWS, MIN_TOKENS, fit_to_device

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


class _Bundle:
    """A bundle's shape at a real vocabulary (SmolLM2-135M: V 49,152, H 576) without its weights."""

    def __init__(self, V=49_152, H=576):
        self.lm_head = torch.empty(V, H, device="meta")
        self.config = {"hidden_size": H, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                       "intermediate_size": 1536}


def test_dflash_rows_fit_the_device_from_the_shapes_alone():
    run = load_run_config("dflash")
    assert run.drafter.max_loss_rows is None
    per_row = 2 * 2 * 49_152 * 576  # the draft's logits and the CE gradient
    assert run.drafter.loss_row_flops(49_152, 576) == per_row
    cpu, line = fit_to_device(run, _Bundle(), CPU)
    assert cpu.drafter.max_loss_rows == int(LOSS_GFLOP["cpu"] * 1e9 // per_row) > MIN_LOSS_ROWS
    assert cpu.train.max_tokens == run.train.max_tokens  # set by the recipe: kept
    assert "fitted to cpu" in line and "set drafter.max_loss_rows=N" in line and "s a step" in line
    assert fit_to_device(run, _Bundle(), CPU)[0] == cpu  # no timing decides: a resume fits the same budget
    gpu, line = fit_to_device(run, _Bundle(151_936, 1024), GPU)
    assert gpu.drafter.max_loss_rows == 8195 and "probe" not in line  # the former 8192 at Qwen3's shape
    kd = dataclasses.replace(run, drafter=dataclasses.replace(run.drafter, kd="exact", ce_weight=0.0))
    assert kd.drafter.loss_row_flops(10, 2) == 2 * 3 * 10 * 2  # draft, teacher, KD gradient: no CE gradient


def test_a_set_budget_is_kept_quietly():
    run = load_run_config("dflash", overrides=["drafter.max_loss_rows=300"])
    assert fit_to_device(run, _Bundle(), CPU) == (run, None)
    run = load_run_config("eagle3", overrides=["drafter.max_loss_rows=300"])  # tokens still fitted: said
    fitted, line = fit_to_device(run, _Bundle(), CPU)
    assert fitted.drafter.max_loss_rows == 300 and "at most 300 loss rows (as set" in line


def test_eagle3_fits_rows_and_tokens_on_cpu_only():
    run = load_run_config("eagle3")
    assert run.drafter.max_loss_rows is None and run.train.max_tokens is None
    cpu, _ = fit_to_device(run, _Bundle(), CPU)
    per_row = 2 * 4 * 49_152 * 576  # teacher, draft, the rows' and the head's gradients
    assert cpu.drafter.max_loss_rows == int(LOSS_GFLOP["cpu"] * 1e9 // per_row)
    per_token = cpu.drafter.token_flops(_Bundle())
    assert cpu.train.max_tokens == max(MIN_TOKENS, int(DRAFT_GFLOP["cpu"] * 1e9 // per_token)) < DEFAULT_TOKENS
    gpu, _ = fit_to_device(run, _Bundle(), GPU)
    assert gpu.train.max_tokens == DEFAULT_TOKENS and gpu.drafter.max_loss_rows > cpu.drafter.max_loss_rows


def test_families_without_a_budget_pass_through():
    run = load_run_config("mtp")
    assert fit_to_device(run, tiny_bundle(), CPU) == (run, None)


def test_an_unfitted_dflash_config_keeps_the_former_budget():
    cfg = DFlashConfig(max_loss_rows=None)
    assert cfg.train_anchors == min(cfg.max_total_anchors, UNFITTED_LOSS_ROWS // (cfg.block_size - 1))
    with pytest.raises(ValueError, match="max_loss_rows"):
        DFlashConfig(block_size=8, max_loss_rows=6)


def test_auto_head_dtype_is_bf16_where_it_pays(monkeypatch):
    import tapdraft.train.fit as fit
    big, small = fit.BF16_HEAD_MIN_WEIGHTS, fit.BF16_HEAD_MIN_WEIGHTS - 1
    monkeypatch.setattr(fit, "cpu_has_bf16", lambda: True)
    assert fit.head_dtype(CPU, "auto", big) == torch.bfloat16
    assert fit.head_dtype(CPU, "auto", small) == torch.float32  # a toy head: its matmuls cost little either way
    assert fit.head_dtype(GPU, "auto", small) == torch.bfloat16
    assert fit.head_dtype(CPU, "float32", big) == torch.float32
    monkeypatch.setattr(fit, "cpu_has_bf16", lambda: False)  # emulated bf16 is slower than fp32
    assert fit.head_dtype(CPU, "auto", big) == torch.float32
    assert fit.head_dtype(CPU, "bfloat16", small) == torch.bfloat16


def test_bf16_instructions_are_read_from_the_cpu_flags():
    from tapdraft.train.fit import cpuinfo_has_bf16

    x86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw {}\nbugs\t\t: spectre_v1\n"
    assert cpuinfo_has_bf16(x86.format("avx512_bf16"))
    assert cpuinfo_has_bf16(x86.format("amx_bf16 amx_tile"))
    assert not cpuinfo_has_bf16(x86.format("avx512_vnni"))
    assert cpuinfo_has_bf16("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert not cpuinfo_has_bf16("processor\t: 0\nFeatures\t: fp asimd\nmodel name\t: bf16 lookalike\n")
