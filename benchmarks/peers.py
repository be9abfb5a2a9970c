"""tapdraft's training steps beside its peers' (NVIDIA Model-Optimizer, vllm-project/speculators), one row per family
both train, same samples and shape.

Each peer runs in its own venv built from pins, driven by a runner that imports only the peer's packages:
ModelOpt by ``engines/peers/modelopt_runner.py`` (``engines/venv.sh modelopt``: nvidia-modelopt 0.47.0, torch 2.13.0
CPU, the transformers it allows), speculators by ``engines/peers/speculators_runner.py`` in the vLLM engine venv
(``engines/venv.sh vllm``: engines/vllm.txt pins speculators 0.9.0 beside vLLM; that venv takes long to build, so
the speculators rows are not in the default ``--rows``). For each row this module builds a small tapdraft dataset
itself, converts it to the peer's offline format (``to_modelopt``, ``to_speculators``: the family's taps by
tapdraft's rule), then times interleaved pairs: one tapdraft step, one peer step, ...

    python -m benchmarks.peers [--rows dflash-ce,dflash-kd,eagle3,dspark] [--pairs 7] [--anchors 32] [--samples 2]
                               [--heldout 2] [--tokens 512] [--precision bfloat16|float32] [--workdir DIR]
    python -m benchmarks.peers --rows dflash-ce-speculators,dflash-kd-speculators,eagle3-speculators,dspark-speculators
    python -m benchmarks.peers --precision bfloat16 --peer-precision float32 --mixed   # a labelled mixed row

Equal terms, enforced per row:

  precision   ``--precision`` (default bfloat16) sets both sides: bfloat16 is how each peer runs on a real
              checkpoint (ModelOpt: every part in its base checkpoint's dtype, the converter writes it bf16;
              speculators: its Trainer's bf16 autocast over fp32 weights, engines/*_runner.py cite the source) and
              tapdraft with its bf16 frozen head and bf16 autocast over fp32 trainable weights; float32 is the control,
              fp32 everywhere. Each side reports the dtype its frozen head's matmul, its embedding rows and its
              trainable draft's matmuls ran in (forward hooks, autocast included) and the trainable weights' dtype; a
              row whose head / embedding / draft dtypes differ is refused in one line (``check_dtypes``) unless
              ``--mixed``, which runs and labels it "mixed" in the table and JSON. What equal does not cover, and each
              row records (``draft_params``): ModelOpt's bf16 keeps its trainable weights and AdamW state in bf16 (no
              fp32 master copy), tapdraft and speculators keep them fp32.
  anchors     fresh every step on both sides: tapdraft's from one generator seeded once per row and advanced by each
              step, the peers' from their own RNG (seeded once per process). Neither peer takes given anchors (its
              sampler is internal), so the two sequences are independent draws of the same distribution, not the
              same positions: each row says so. EAGLE-3 has no anchors (every supervised row, every step).
  held-out    after the timed steps, each side's loss on ``--heldout`` samples it never trained on (the dataset's
              last ones: tapdraft's batch, ModelOpt's held-out files, speculators' rows after the training ones), no
              gradient, the RNG seeded with ``HELDOUT_SEED`` on both: after equal steps, so a faster step that learns
              less shows as a worse held-out loss; then after equal seconds: the side whose timed steps took less
              time trains on (``catch_up``, at most 4 x ``--pairs`` more steps) until it has spent the other's
              seconds, and its held-out loss is taken again (``heldout_equal_time``: the side, its extra steps).
  loss        the same loss on the same labels: the samples are self-predicting (every next token is the teacher's
              argmax, benchmarks/shapes.py), so speculators' CE on the teacher's argmax and tapdraft's CE on the
              dataset token train one label; ``argmax_agreement`` checks it (1.0) before the row runs, in both
              precisions, or refuses it.
  spread      the per-pair ratios, their median, min and max (``ratio_spread``) and the 1-minute load average at every
              pair, in the table and JSON; fewer than 5 pairs warns that the figure is a smoke test.

Content: a synthetic target bundle at SmolLM2-135M's widths (``llama-576x8`` in benchmarks/shapes.py:
hidden 576, 9/3 heads, MLP 1536, vocab 49,152, 8 layers; random fp32-exact bf16 embedding and lm_head) and
``--samples`` + ``--heldout`` samples of ``--tokens`` tokens (random ids, each the teacher's argmax on the
previous position; the second half supervised) whose taps are the family's (DFlash's and DSpark's one-layer
rule: layer 4; EAGLE-3's ``eagle3_tap_ids``: 1, 3, 5) plus the last
layer. Random activations are fine for time: it does not depend on their values; the losses both sides report
say they train the same rows from the same loss.

Common to every row: 1 draft layer at the target's widths (passed to ModelOpt explicitly), frozen embedding
and lm_head (both sides in ``--precision``, above), AdamW (tapdraft's recipe lr,
betas, weight decay; no schedule, no clipping on either side), one micro-batch of the ``--samples`` training
samples, the same batch every step (so both have seen equal tokens after equal steps), one torch thread each,
torch.compile off.
One step = forward + backward + optimizer step, timed inside each process. Trainable parameters are
counted on both sides and recorded (equal in every row: 3,873,152 DFlash, 5,089,536 EAGLE-3, 29,039,809
DSpark).

Rows:

  dflash-ce   tapdraft ``dflash`` vs ModelOpt DFlash (``dflash_loss_objective="decay"``): block 16, slot weights
              exp(-(k-1)/7), ``--anchors`` anchors per sequence whose block fits (tapdraft ``full_blocks_only``;
              ModelOpt samples them in [0, T - 16]), CE on the dataset's tokens.
  dflash-kd   the same with distillation only: tapdraft ``kd=exact ce_weight=0``, ModelOpt
              ``dflash_self_logit_distillation=True`` (its KD path replaces CE). Both teachers are the base head on
              the row that predicts the slot's token (last hidden at anchor + k - 1 -> final norm -> lm_head),
              weighted by the same slot decay. They differ in the value, not the gradient: tapdraft's term is
              KL(p || q), ModelOpt's the soft cross-entropy -sum p log q = KL + H(p); the table adds H(p)
              (``teacher_entropy``) to tapdraft's figure to compare. ModelOpt projects every position's base
              logits [B, T, V] and gathers the teacher rows; tapdraft projects only the trained rows, in chunks.
  eagle3      tapdraft ``eagle3`` vs ModelOpt EAGLE-3 offline (``mtsp.convert(model, [("eagle", cfg)])`` with its
              ``eagle3_default_config``): ``TTT_STEPS`` = 3 training-time-test steps (ModelOpt's default; the recipe
              has 5), step weights 0.8^j (tapdraft's; ModelOpt's default 0.9), a Llama layer (tapdraft
              ``qk_norm=false``; its recipe's default is Qwen3's QK-norm), the full vocabulary on both (ModelOpt
              maps a d2t only when ``draft_vocab_size`` is set; tapdraft ``draft_vocab=null``), the target's frozen
              lm_head as the draft's head (ModelOpt has no own head without a draft vocabulary: tapdraft
              ``train_lm_head=false``), a trained final norm on both, every supervised row at every step
              (``max_loss_rows`` = samples x tokens x steps, more than there are). The loss is the forward KL on
              both against the exact teacher rows, each step normalised by its own row count: again ModelOpt's
              value is the soft CE, H(p) x (1 + 0.8 + 0.64) above tapdraft's. Rows: tapdraft trains step j at row t
              when the token t + j + 2 is supervised, ModelOpt when its mask is set at the teacher row t + j + 1
              (its masks mark assistant tokens): the same count per step on these samples, one position apart
              (ModelOpt also trains the last row, whose teacher predicts past the end; tapdraft the row before the
              first supervised token). Inits differ (tapdraft's norm starts at the target's, its linears at std
              0.02; ModelOpt's are torch's defaults): the first losses agree closely (tests: within 0.25), not exactly.
  dspark      tapdraft ``dspark`` vs ModelOpt DSpark (DFlash's mode with ``projector_type="dspark"``, ``HFDSparkModel``;
              not in the default ``ROWS``: a step costs about twice a DFlash CE step; ``--rows dspark``). The same
              model: DFlash's backbone, the vanilla rank-256 Markov head (its own V x r embedding ``markov_w1``, r -> V
              ``markov_w2``, no bias; tapdraft names them ``markov_head.markov_w{1,2}``, ModelOpt flat, its loader
              takes both), the confidence head Linear(H + r -> 1, bias) over [h ; markov_w1[prev]], normal(0, 0.02)
              head inits on both: DFlash's 3,873,152 + 2 x 49,152 x 256 + 833 trainable. The same slots: slot k
              (from 0, slot 0 included) predicts anchor + k + 1 given the teacher-forced token at anchor + k,
              weighted exp(-k / 7), teacher row anchor + k; anchors in [0, T - 16] on both (a block at T - 16 loses
              its last slot, past the end, on both; sampled independently, the counts differ by at most one per
              sample). The same loss, tapdraft's recipe weights on both: 0.1 CE(z) + 0.9 sum_v |p - q| + 0.1
              BCE(c, 1 - TV) (ModelOpt's confidence weight defaults to 0 and its head to off: the job sets them);
              ModelOpt divides every term by one slot-weighted count, tapdraft each by its own, the same count with
              an exact teacher. The teacher: tapdraft ``kd=exact`` (the base head on the stored last hidden), as
              ModelOpt's offline path computes it (its only one: it reads no stored top-k); the recipe's default
              ``kd: topk`` is another loss (the lumped-tail L1, a lower bound). The L1 is the same quantity on both
              sides, so the losses compare with no offset (tests: the first within 0.25; measured 1.655 / 1.650).
              ModelOpt projects every position's base logits for its teachers (at 32 anchors x 16 slots on 512
              tokens as many rows as tapdraft's trained ones), tapdraft only the trained rows.

Reported per row and side: median s/step, tokens/s (batch tokens / s), loss rows, peak RSS (tapdraft: this
process since the row began, Linux's VmHWM reset per row, imports, data and what earlier rows left allocated
included: ``--rows`` one row per process for a clean figure; the peer: its runner process, one per row, VmHWM
since its exec), the dtypes (head / embedding / draft, and the trainable weights'), the loss per row after the
warm-up + ``--pairs`` steps and the held-out loss before the first step and after them (the start shows what the
two measures read from the inits alone: rows, anchors and inits differ); and the median over pairs of peer s /
tapdraft s with its min and max, and the 1-minute load average at every pair. Numbers taken beside other work on
the machine are noisy: read the ratio (median of interleaved pairs) and the load, not the absolute times.

speculators rows (``engines/peers/speculators_runner.py`` says how it is driven and why): its Trainer hard-codes CUDA
and its default FlexAttention refuses gradients on CPU, so the runner builds its ``DFlashDraftModel`` as its training
CLI does (qwen3 layer at the verifier's widths: 3,873,152 trainable, as tapdraft's; embedding, lm_head, final norm
frozen from the verifier directory; at bfloat16 under its Trainer's autocast), with its CLI's ``sdpa``
attention and its ``eager`` losses, and calls it as its Trainer does on the batch its ``ArrowDataset`` +
``CollateFn`` make (every training sample packed in one row).

  dflash-ce-speculators   tapdraft ``dflash`` (CE on the dataset's token) vs its ``loss_fn=ce``: a hard-label CE on
              the argmax of the teacher row (last hidden at anchor + k - 1 -> final norm -> lm_head). On these
              self-predicting samples that argmax is the dataset's token at every supervised position
              (``argmax_agreement``, checked before the row runs): one loss on one label. speculators still
              projects the teacher rows to find it (its cost, kept in its time); tapdraft reads the token.
  dflash-kd-speculators   tapdraft ``kd=exact ce_weight=0`` vs its ``loss_fn=kl_div``: KL(p || q) against the same
              teacher row on both sides, no offset.
  Both: block 16, slot weights exp(-(k-1)/7) (its ``dflash_decay_gamma=7``, default 4), anchors = ``--anchors`` x
  ``--samples`` per packed row (its ``max_anchors``) drawn among supervised positions except the row's last 16;
  tapdraft ``--anchors`` per sequence whose block fits. A speculators block may run past its sample's end into the
  next sample's unsupervised prompt, those slots masked: it trains the same blocks, a few rows fewer on some
  draws (the table shows both counts). Its loss is sum(w l) / rows, tapdraft's sum(w l) / sum(w): the table gives
  its loss rescaled to tapdraft's rule (rows / sum(w), reported by the runner) with its own figure in brackets.
  eagle3-speculators   tapdraft ``eagle3`` at the ``eagle3`` row's settings vs its ``Eagle3DraftModel`` (llama
              layer, its architecture switches set to tapdraft's draft: no norm before the residual, before the fc or
              on the fed-back output; lm_head frozen, final norm trained on both: 5,089,536 trainable), ``kl_div``
              against the exact teacher rows, ``ttt_steps`` 3, each step over its own rows times 0.8^j (its
              ``ttt_step_loss_decay``; its default 1.0), summed: tapdraft's loss, no offset. The same rows: its loader
              keeps the mask one token early for EAGLE-3, so the converter writes it one position earlier
              (``to_speculators``). Inits differ (its torch defaults and a final norm of ones against tapdraft's std
              0.02 and the target's norm).
  dspark-speculators   tapdraft ``dspark`` at the ``dspark`` row's settings vs its ``DSparkDraftModel``: DFlash's
              backbone predicting from the anchor on (its ``sample_from_anchor``, slot k -> anchor + k + 1, weights
              exp(-k / 7)), the vanilla rank-256 Markov head, the confidence head over [h ; markov_w1[prev]]
              (29,039,809 trainable on both), loss ``{"ce": 0.1, "tv": 1.8}`` + 0.1 x BCE(c, 1 - TV): its tv is TV,
              tapdraft's L1 is 2 TV, so this is tapdraft's 0.1 CE + 0.9 L1 + 0.1 BCE; CE on the teacher's argmax =
              the dataset token, as the DFlash CE row. Anchors and normalisation as the DFlash rows (its loss
              rescaled by rows / sum(w)). Inits differ (its Markov w1 at std 0.01 and torch's default for w2).

Not compared (say so in docs/performance.md): DFlash2 and MTP against either peer (no counterpart measured).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from benchmarks.common import write_result
from benchmarks.shapes import SHAPES, shape_facts, synthetic_dataset
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.taps import default_tap_ids, eagle3_tap_ids

if TYPE_CHECKING:
    from tapdraft.train.drafters.base import LossOutput

SHAPE = "llama-576x8"
BLOCK = 16
GAMMA = 7.0
DRAFT_LAYERS = 1
TTT_STEPS = 3
"""EAGLE-3's training-time-test steps on both sides (ModelOpt's default ``eagle_ttt_steps``; the recipe has 5)."""
STEP_DECAY = 0.8
"""EAGLE-3's per-step loss weight base on both sides (tapdraft's recipe; ModelOpt's default is 0.9)."""
ROWS = ("dflash-ce", "dflash-kd", "eagle3")
PRECISIONS = ("bfloat16", "float32")
"""``--precision``: bfloat16, both sides as the peers run on real checkpoints (the default); float32, the control."""
DTYPE_PARTS = ("head", "embedding", "draft")
"""The parts whose compute dtype each side records and a row requires equal (unless ``--mixed``): the frozen
lm_head's matmuls, the frozen embedding rows the draft reads, the trainable draft's matmuls."""
HELDOUT_SEED = 1234
"""The RNG seed of every held-out evaluation (its anchors), on both sides (engines/peers/peer_protocol.py's too)."""
ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "engines" / "peers" / "modelopt_runner.py"


TAP_RULES = {"dflash": lambda L: default_tap_ids(L, DRAFT_LAYERS), "eagle3": eagle3_tap_ids,
             "dspark": lambda L: default_tap_ids(L, DRAFT_LAYERS)}
"""Each compared family's taps over L target layers, by tapdraft's rule (``shards.taps``)."""


def family_taps(family: str, num_layers: int) -> list[int]:
    """The taps a family's drafter fuses (ModelOpt reads them as ``aux_hidden_states``)."""
    if family not in TAP_RULES:
        raise ValueError(f"no ModelOpt counterpart compared for family {family!r}; known: {sorted(TAP_RULES)}")
    return list(TAP_RULES[family](num_layers))


def build_dataset(root: Path, *, samples: int = 2, tokens: int = 512, seed: int = 0, family: str = "dflash",
                  self_predicting: bool = True) -> Path:
    """The synthetic dataset at SHAPE storing ``family``'s taps and the last layer, ``tokens`` a sample (built once
    per argument set; later runs reuse ``root``), by default one whose every next token is the teacher's argmax
    (``self_predicting``, benchmarks/shapes.py), so a CE on the dataset token and one on the argmax are one loss."""
    taps = tuple(family_taps(family, SHAPES[SHAPE].layers))
    return synthetic_dataset(root, SHAPE, samples=samples, tokens=(tokens, tokens), tag="peers", seed=seed,
                             draft_layers=DRAFT_LAYERS, tap_ids=taps, self_predicting=self_predicting)


def argmax_agreement(dataset: str | Path, dtype: str = "bfloat16", split: str = "train") -> float:
    """The share of supervised tokens (after the first) that equal the teacher's argmax on the previous position
    (last layer -> final norm -> lm_head, the head in ``dtype``): 1.0 when a CE on the dataset token and a CE on
    the teacher's argmax train the same labels."""
    from tapdraft.shards.head import head_spec, teacher_logits

    ds = open_dataset(str(dataset))
    bundle, L = ds.bundle(), ds.layout.num_layers
    col = list(ds.layout.tap_ids).index(L - 1)
    t = getattr(torch, dtype)
    same = total = 0
    for i in range(ds.num_samples(split)):
        s = ds.sample(split, i)
        sup = s["loss_mask"].bool()[1:]
        h = s["taps"][:-1, col][sup].to(t)  # [R, H], the row before each supervised token
        z = teacher_logits(h, bundle.norm_weight.to(t), bundle.lm_head.to(t), head_spec(bundle))
        same += int((z.argmax(-1) == s["input_ids"][1:][sup].long()).sum())
        total += int(sup.sum())
    return same / max(total, 1)


def to_modelopt(dataset: str | Path, out: Path, *, family: str = "dflash", split: str = "train",
                limit: int | None = None, dtype: str = "bfloat16") -> dict[str, Any]:
    """Convert a tapdraft dataset to ModelOpt's offline DFlash / EAGLE-3 format; returns the job facts.

    ModelOpt 0.47.0 reads (``modelopt/torch/speculative/eagle/utils.py``, ``OfflineSupervisedDataset``; both
    families share it) one ``.pt`` file per sample holding a dict: ``input_ids`` [T] (int64), ``hidden_states``
    [T, H] (the base model's last hidden), ``aux_hidden_states`` [T, n * H] (the captured layers, concatenated),
    an optional ``loss_mask`` [T] (read with ``answer_only_loss=True``) and ``hidden_states_prenorm`` (True: the
    last hidden is taken before the final norm, which ModelOpt re-applies when it needs logits: DFlash's
    self-distillation and every EAGLE step). The aux layers are ``family``'s by tapdraft's rule
    (``family_taps``), ascending, as tapdraft's drafter concatenates them: DFlash's is ModelOpt's own
    (``build_target_layer_ids``); EAGLE-3's offline path takes whatever ``aux_hidden_states`` holds (its config
    only sets how many, ``eagle_aux_hidden_state_layer_ids``; its own default for 8 layers would be [1, 3, 4],
    tapdraft's is [1, 3, 5]). Its frozen pieces come from a base checkpoint directory
    (``plugins/modeling_fakebase.py``, ``FakeBaseModel.from_source``: config.json + model.safetensors with
    ``model.embed_tokens.weight``, ``lm_head.weight``, ``model.norm.weight``), written as ``out/base``
    in ``dtype``: ModelOpt builds every part, its trainable draft included, in the base config's dtype
    (engines/peers/modelopt_runner.py cites where), so bfloat16 is its default on a real checkpoint and float32 the
    control. Taps are stored in ``dtype`` too (the dataset's bf16 values, exact either way): the draft reads them
    in its own dtype.

    Layout of ``out``: ``base/`` and ``samples/NNNNNN.pt``; each file is written to a temp name and renamed.
    """
    ds = open_dataset(str(dataset))
    layout, bundle = ds.layout, ds.bundle()
    L = layout.num_layers
    aux = family_taps(family, L)
    missing = [t for t in (*aux, L - 1) if t not in layout.tap_ids]
    if missing:
        raise ValueError(f"{dataset} stores taps {list(layout.tap_ids)}; ModelOpt's offline {family} needs {aux} "
                         f"(tapdraft's layer rule for it) and the last layer {L - 1}: "
                         f"capture with --taps including {missing}")
    col = {t: j for j, t in enumerate(layout.tap_ids)}
    out = Path(out)
    base, samples = out / "base", out / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    config = write_base(bundle, L, base, dtype=dtype)
    n = ds.num_samples(split) if limit is None else min(limit, ds.num_samples(split))
    files = []
    for i in range(n):
        s = ds.sample(split, i)
        taps = s["taps"].to(getattr(torch, dtype))  # [T, n_taps, H]
        doc = {"input_ids": s["input_ids"].long(),
               "hidden_states": taps[:, col[L - 1]].contiguous(),
               "aux_hidden_states": torch.cat([taps[:, col[t]] for t in aux], dim=-1).contiguous(),
               "loss_mask": s["loss_mask"].long(),
               "hidden_states_prenorm": True}
        path = samples / f"{i:06d}.pt"
        _atomic_write(path, lambda p, doc=doc: torch.save(doc, p))
        files.append(str(path))
    arch = {k: config[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")}
    return {"base": str(base), "files": files, "dtype": dtype, "family": family, "target_layer_ids": aux,
            "num_layers": L,
            "vocab_size": bundle.vocab_size, "hidden_size": bundle.hidden_size, "architecture": arch,
            "rope_theta": config["rope_theta"]}


def write_base(bundle: Any, num_layers: int, base: Path, dtype: str = "bfloat16") -> dict[str, Any]:
    """The frozen target pieces as a Llama checkpoint directory both peers load their base from: config.json (the
    target's widths, ``"dtype": dtype``) and model.safetensors (``model.embed_tokens.weight``, ``lm_head.weight``,
    ``model.norm.weight`` in ``dtype``: bfloat16 as a real checkpoint, the bundle's values exactly); returns the
    config."""
    if dtype not in PRECISIONS:
        raise ValueError(f"base dtype {dtype!r}: choose one of {PRECISIONS}")
    from safetensors.torch import save_file

    base.mkdir(parents=True, exist_ok=True)
    L = num_layers
    c = bundle.config
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": bundle.hidden_size,
              "num_hidden_layers": L, "vocab_size": bundle.vocab_size,
              "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
              "head_dim": c.get("head_dim", bundle.hidden_size // c["num_attention_heads"]),
              "intermediate_size": c["intermediate_size"], "rms_norm_eps": bundle.head.eps,
              "rope_theta": c.get("rope_theta", 10_000.0), "max_position_embeddings": 8192,
              "tie_word_embeddings": False, "dtype": dtype}
    _atomic_write(base / "config.json", lambda p: p.write_text(json.dumps(config, indent=2)))
    t = getattr(torch, dtype)
    weights = {"model.embed_tokens.weight": bundle.embed_tokens.to(t).contiguous(),
               "lm_head.weight": bundle.lm_head.to(t).contiguous(),
               "model.norm.weight": bundle.norm_weight.to(t).contiguous()}
    _atomic_write(base / "model.safetensors", lambda p: save_file(weights, str(p)))
    return config


def to_speculators(dataset: str | Path, out: Path, *, family: str = "dflash", split: str = "train",
                   limit: int | None = None, dtype: str = "bfloat16") -> dict[str, Any]:
    """Convert a tapdraft dataset to speculators' offline format for ``family``'s draft; returns the job facts.

    speculators 0.9.0 trains from a data directory (``speculators/train/data.py``, ``ArrowDataset`` with
    ``FileTransfer``): an Arrow dataset saved with ``datasets.save_to_disk`` holding ``input_ids`` [T] and
    ``loss_mask`` [T] (int64) and ``seq_len`` per row, as its ``prepare_data`` writes it, and one
    ``hidden_states/hs_{i}.safetensors`` per row with ``token_ids`` [T] (equal to the row's ``input_ids``, or the
    sample is refused) and ``hidden_states`` [T, n + 1, H]: the aux layers, ascending, then the verifier's last
    layer (it splits off ``[:, :-1]`` as the context, ``[:, -1]`` as ``verifier_last_hidden_states``, the
    teacher's input before the final norm). Stored in the dataset's bf16, as its vLLM capture writes them; its
    ``CollateFn`` casts them to the training dtype. The aux layers are the family's by tapdraft's rule; speculators
    names them by vLLM layer id, tap + 1 (``aux_layer_ids``; ``train.drafters.dflash.export``). Its frozen
    pieces load from the verifier directory ``out/verifier`` (``write_base`` in ``dtype``; its loader copies
    them into its own fp32 parameters either way, and the runner sets their precision). Layout: ``verifier/``, ``data/``
    (written under a temp name and renamed).

    EAGLE-3: its loader shifts each sample (``shift_batch``: row t pairs the aux hidden at t with the token at t + 1
    and the teacher row t + 1, which predicts the token t + 2) and keeps the mask of the token t + 1, so it would train
    the row that predicts one past a sample's end and skip the one that predicts its first supervised token. The
    mask is written one position earlier (``loss_mask[i]`` = the dataset's ``loss_mask[i + 1]``, 0 at the end): its
    rows are then tapdraft's, the rows whose predicted token is supervised, in training and held out alike.
    """
    import shutil

    from datasets import Dataset
    from safetensors.torch import save_file

    ds = open_dataset(str(dataset))
    layout, bundle = ds.layout, ds.bundle()
    L = layout.num_layers
    aux = family_taps(family, L)
    missing = [t for t in (*aux, L - 1) if t not in layout.tap_ids]
    if missing:
        raise ValueError(f"{dataset} stores taps {list(layout.tap_ids)}; speculators' offline {family} needs {aux} "
                         f"(tapdraft's layer rule) and the last layer {L - 1}: capture with --taps including {missing}")
    col = [list(layout.tap_ids).index(t) for t in (*aux, L - 1)]
    out = Path(out)
    write_base(bundle, L, out / "verifier", dtype=dtype)
    data, tmp = out / "data", out / "data.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "hidden_states").mkdir(parents=True)
    n = ds.num_samples(split) if limit is None else min(limit, ds.num_samples(split))
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(n):
        s = ds.sample(split, i)
        ids = s["input_ids"].long()
        save_file({"hidden_states": s["taps"][:, col].contiguous(), "token_ids": ids.contiguous()},
                  str(tmp / "hidden_states" / f"hs_{i}.safetensors"))
        rows["input_ids"].append(ids.tolist())
        mask = s["loss_mask"].long()
        if family == "eagle3":  # one position earlier: its shift keeps the mask of the token BEFORE the predicted one
            mask = torch.cat([mask[1:], mask.new_zeros(1)])
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(int(ids.numel()))
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(tmp / "arrow"))
    for f in (tmp / "arrow").iterdir():  # the dataset's own files beside hidden_states/, as its data dir holds them
        os.replace(f, tmp / f.name)
    (tmp / "arrow").rmdir()
    shutil.rmtree(data, ignore_errors=True)
    os.replace(tmp, data)
    return {"verifier": str(out / "verifier"), "data": str(data), "samples": n, "tokens": sum(rows["seq_len"]),
            "lengths": rows["seq_len"], "dtype": dtype,
            "target_layer_ids": aux, "aux_layer_ids": [t + 1 for t in aux], "num_layers": L,
            "vocab_size": bundle.vocab_size, "hidden_size": bundle.hidden_size}


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Row:
    """One compared pair: tapdraft's recipe and overrides, the peer, its mode (ModelOpt's ``mtsp.convert`` mode;
    speculators' ``loss_fn``) and how to read it."""

    family: str
    loss: str
    label: str
    recipe: str
    mode: str
    peer: str = "modelopt"


ROW_SPECS = {
    "dflash-ce": Row("dflash", "ce", "DFlash CE", "dflash", "dflash"),
    "dflash-kd": Row("dflash", "kd", "DFlash KD (exact teacher, CE off) vs self-distillation", "dflash", "dflash"),
    "eagle3": Row("eagle3", "kl", "EAGLE-3 KL", "eagle3", "eagle"),
    "dflash-ce-speculators": Row("dflash", "ce", "DFlash CE (the dataset token = the teacher's argmax)", "dflash",
                                 "ce", "speculators"),
    "dflash-kd-speculators": Row("dflash", "kd", "DFlash KD (exact teacher, CE off) vs kl_div", "dflash", "kl_div",
                                 "speculators"),
    "eagle3-speculators": Row("eagle3", "kl", "EAGLE-3 KL", "eagle3", "kl_div", "speculators"),
    "dspark-speculators": Row("dspark", "ce+l1", "DSpark 0.1 CE + 0.9 L1 + 0.1 confidence BCE (exact teacher)",
                              "dspark", "ce+tv", "speculators"),
    "dspark": Row("dspark", "ce+l1", "DSpark 0.1 CE + 0.9 L1 + 0.1 confidence BCE (exact teacher)", "dspark",
                  "dspark"),
}
PEERS = {"modelopt": "ModelOpt", "speculators": "speculators"}
"""Each peer's name in the table; its venv (``engines/venv.sh``) and runner (``engines/<peer>_runner.py``)."""
PEER_VENV = {"modelopt": "modelopt", "speculators": "vllm"}


def tapdraft_overrides(row: Row, *, anchors: int, samples: int, tokens: int, mask_token_id: int,
                       precision: str = "bfloat16") -> list[str]:
    """The recipe overrides that put tapdraft's side at the peer's settings (module docstring); ``precision`` is
    both the frozen head's dtype and the draft's autocast (``train.precision``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {PRECISIONS}")
    batch = [f"max_batch_size={samples}", f"max_tokens={samples * tokens}", f"head_dtype={precision}",
             f"precision={precision}"]
    if row.family == "eagle3":
        return [f"num_steps={TTT_STEPS}", "qk_norm=false", "loss_type=kl", "teacher=exact",
                f"step_decay={STEP_DECAY}", "draft_vocab=null", "train_lm_head=false",
                f"max_loss_rows={samples * tokens * TTT_STEPS}", *batch]
    if row.family == "dspark":  # the recipe's head and loss weights, spelled out: the runner passes them on
        return [f"num_anchors={anchors}", "full_blocks_only=true", f"mask_token_id={mask_token_id}",
                f"max_loss_rows={samples * tokens * BLOCK}", f"max_total_anchors={samples * anchors}", "kd=exact",
                "markov_rank=256", "markov_head_type=vanilla", "confidence_head=true", "ce_weight=0.1",
                "tv_weight=0.9", "confidence_weight=0.1", *batch]
    kd = ["kd=exact", "ce_weight=0"] if row.loss == "kd" else []
    return [f"num_anchors={anchors}", "full_blocks_only=true", f"mask_token_id={mask_token_id}", "slot_weighting=decay",
            f"max_loss_rows={samples * tokens * BLOCK}", f"max_total_anchors={samples * anchors}", *kd, *batch]


def teacher_entropy(dataset: str | Path, split: str = "train", indices: range | None = None) -> float:
    """Mean entropy H(p) of the target's next-token distribution over the supervised rows (last hidden -> final
    norm -> lm_head, ``shards.head.teacher_logits``, fp32): ModelOpt's distillation losses are the soft
    cross-entropy -sum p log q = KL(p || q) + H(p), tapdraft's the KL, so the peer's loss per row sits H(p) above
    (same gradient). ``indices``: the samples to average over (default all)."""
    from tapdraft.shards.head import head_spec, teacher_logits

    ds = open_dataset(str(dataset))
    bundle, L = ds.bundle(), ds.layout.num_layers
    col = list(ds.layout.tap_ids).index(L - 1)
    total, n = 0.0, 0
    for i in range(ds.num_samples(split)) if indices is None else indices:
        s = ds.sample(split, i)
        h = s["taps"][s["loss_mask"].bool(), col].float()  # [R, H]
        z = teacher_logits(h, bundle.norm_weight.float(), bundle.lm_head.float(), head_spec(bundle))
        logp = torch.log_softmax(z.float(), dim=-1)
        total += float(-(logp.exp() * logp).sum())
        n += h.shape[0]
    return total / max(n, 1)


class TapdraftSide:
    """A tapdraft recipe at the peer's settings (``tapdraft_overrides``): one fixed micro-batch of the dataset's
    first ``samples`` samples, the next ``heldout`` held out (never trained on).

    Anchors are fresh every step: one generator seeded once per row (``seed``) and advanced by every step, as the
    peers draw theirs from their global RNG. ``precision`` bfloat16: the frozen embedding and lm_head stored in bf16
    and the forward under CPU bf16 autocast (``train.precision``, as the loop runs it), fp32 trainable weights;
    float32: no autocast, fp32 head.
    """

    def __init__(self, data: Path, row: Row, *, anchors: int, samples: int, tokens: int, mask_token_id: int,
                 precision: str = "bfloat16", heldout: int = 0, seed: int = 0) -> None:
        from tapdraft.train.config import load_run_config
        from tapdraft.train.data import collate
        from tapdraft.train.drafters.base import combine_terms
        from tapdraft.train.loop import make_optimizer
        from tapdraft.train.run import build_drafter
        from tapdraft.train.source import open_source

        self.row, self.precision = row, precision
        self.run = load_run_config(row.recipe, overrides=tapdraft_overrides(
            row, anchors=anchors, samples=samples, tokens=tokens, mask_token_id=mask_token_id, precision=precision))
        src = open_source(str(data))
        if src.num_samples < samples + heldout:
            raise ValueError(f"{data} holds {src.num_samples} samples; the row needs {samples} + {heldout} held out")
        self.model = build_drafter(self.run, src)
        self.head_dtype = getattr(torch, precision)
        self.model.target.to_dtype(self.head_dtype)
        self.opt, _ = make_optimizer(self.model, self.run.train)
        for g in self.opt.param_groups:  # the schedule's constructor applied warm-up step 0 (lr / 100): undo it
            g["lr"] = self.run.train.lr
        self.batch = collate([src.data.sample(src.split, i) for i in range(samples)])
        self.heldout = collate([src.data.sample(src.split, i) for i in range(samples, samples + heldout)]) \
            if heldout else None
        self.tokens = int(self.batch["lengths"].sum())
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.combine = combine_terms
        self.generator = torch.Generator().manual_seed(seed)
        self._dtypes: dict[str, set[str]] = {}
        for m in self.model.modules():  # the draft's matmuls as they ran (autocast included)
            if isinstance(m, torch.nn.Linear) and m.weight.requires_grad:
                m.register_forward_hook(lambda mod, a, out: self._dtypes.setdefault("draft", set()).add(
                    str(out.dtype).removeprefix("torch.")))

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bfloat16")

    def dtypes(self) -> dict[str, str]:
        """What each part computed in (``DTYPE_PARTS``): the frozen head's matmul and embedding rows are the stored
        tensors' dtype (the fused loss projects with them), the draft's from forward hooks on its linears."""
        t = self.model.target
        return {"head": str(t.lm_head.dtype).removeprefix("torch."),
                "embedding": str(t.embed_tokens.dtype).removeprefix("torch."),
                "draft": "/".join(sorted(self._dtypes.get("draft", ()))) or "none"}

    def draft_params(self) -> str:
        return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in self.model.parameters()
                                if p.requires_grad}))

    def rows(self, lo: LossOutput) -> int:
        """Loss rows of a step: DFlash's trained slots (its acc@k counts), EAGLE-3's rows over all steps."""
        if self.row.family == "eagle3":
            return int(sum(float(c) for _, c, _ in lo.terms.values()))
        return int(sum(float(c) for k, (_, c) in lo.metrics.items() if k.startswith("acc@")))

    def step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self._autocast():
            lo = self.model(self.batch, self.generator)
            loss, _ = self.combine(lo.terms)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        s = time.perf_counter() - t0
        return {"s": s, "loss": float(loss.detach()), "rows": self.rows(lo), "dtypes": self.dtypes()}

    @torch.no_grad()
    def heldout_loss(self) -> dict[str, Any]:
        """The training loss on the held-out batch, no gradient, anchors from ``HELDOUT_SEED`` (the peers' runners
        seed theirs the same way)."""
        if self.heldout is None:
            raise ValueError("no held-out samples: build the side with heldout > 0")
        with self._autocast():
            lo = self.model(self.heldout, torch.Generator().manual_seed(HELDOUT_SEED))
            loss, _ = self.combine(lo.terms)
        return {"loss": float(loss), "rows": self.rows(lo)}


class ModelOptSide:
    """engines/<peer>_runner.py (default ModelOpt's) in the peer's venv, one step per request (stderr to ``log``)."""

    def __init__(self, python: Path, job: dict[str, Any], work: Path, peer: str = "modelopt") -> None:
        work.mkdir(parents=True, exist_ok=True)
        job_path = work / f"{peer}_job.json"
        job_path.write_text(json.dumps(job))
        self.peer = peer
        self.log = work / f"{peer}_runner.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(job.get("threads", 1)), "MKL_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        runner = RUNNER if peer == "modelopt" else ROOT / "engines" / "peers" / f"{peer}_runner.py"
        self.proc = subprocess.Popen([str(python), str(runner), str(job_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the {PEERS[self.peer]} runner exited ({self.proc.returncode}); its log "
                               f"{self.log} ends:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def ask(self, cmd: str) -> dict[str, Any]:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def step(self) -> dict[str, Any]:
        return self.ask("step")

    def close(self) -> dict[str, Any]:
        out = self.ask("exit")
        self.proc.wait(timeout=60)
        return out


def peer_python(name: str = "modelopt") -> Path:
    """The peer venv's python (``engines/venv.sh NAME`` builds it from its pins on first use: minutes)."""
    res = subprocess.run(["bash", str(ROOT / "engines" / "venv.sh"), name], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"engines/venv.sh {name} failed:\n{res.stderr[-3000:]}")
    return Path(res.stdout.strip().splitlines()[-1]) / "bin" / "python"


def modelopt_job(conv: dict[str, Any], run: Any, *, anchors: int, tokens: int, mask_token_id: int,
                 row: Row = ROW_SPECS["dflash-ce"], samples: int | None = None) -> dict[str, Any]:
    """The runner's job: the converted data (the first ``samples`` files train, the rest are held out; default all
    train), ``row``'s mode and tapdraft's drafter and optimizer settings; its precision is the converted base's."""
    d, t = run.drafter, run.train
    n = len(conv["files"]) if samples is None else samples
    job = {"mode": row.mode, "base": conv["base"], "files": conv["files"][:n], "heldout_files": conv["files"][n:],
           "precision": conv["dtype"], "train_len": tokens, "lr": t.lr,
           "betas": [t.beta1, t.beta2], "weight_decay": t.weight_decay, "seed": 0, "threads": 1,
           "architecture": conv["architecture"]}
    if row.mode == "eagle":
        return {**job, "ttt_steps": d.num_steps, "step_decay": d.step_decay, "aux_layer_ids": conv["target_layer_ids"],
                "rope_theta": conv["rope_theta"]}
    job = {**job, "block_size": d.block_size, "num_anchors": anchors, "gamma": d.gamma, "mask_token_id": mask_token_id,
           "draft_layers": d.num_layers, "self_distillation": row.loss == "kd"}
    if row.mode == "dspark":
        job.update({"markov_rank": d.markov_rank, "confidence_head": d.confidence_head, "ce_weight": d.ce_weight,
                    "tv_weight": d.tv_weight, "confidence_weight": d.confidence_weight})
    return job


def speculators_job(conv: dict[str, Any], run: Any, *, anchors: int, samples: int, mask_token_id: int,
                    row: Row = ROW_SPECS["dflash-ce-speculators"]) -> dict[str, Any]:
    """engines/peers/speculators_runner.py's job: the converted data (its first ``samples`` rows train, packed in one
    row, the rest are held out), ``row``'s draft type and loss, tapdraft's drafter and optimizer settings, the converted
    precision; its anchors are per packed row, so tapdraft's per-sequence count x samples."""
    d, t = run.drafter, run.train
    lengths = conv["lengths"]
    job = {"verifier": conv["verifier"], "data": conv["data"], "max_len": sum(lengths[:samples]),
           "train_samples": samples, "heldout_len": sum(lengths[samples:]), "precision": conv["dtype"],
           "loss": row.mode, "draft": row.family, "aux_layer_ids": conv["aux_layer_ids"],
           "draft_layers": getattr(d, "num_layers", 1), "attn": "sdpa", "lr": t.lr, "betas": [t.beta1, t.beta2],
           "weight_decay": t.weight_decay, "seed": 0, "threads": 1}
    if row.family == "eagle3":
        return {**job, "ttt_steps": d.num_steps, "step_decay": d.step_decay}
    job.update({"block_size": d.block_size, "gamma": d.gamma, "max_anchors": anchors * samples,
                "mask_token_id": mask_token_id})
    if row.family == "dspark":  # its tv is TV, tapdraft's L1 is 2 TV: the same loss at twice the weight
        job.update({"loss": json.dumps({"ce": d.ce_weight, "tv": 2 * d.tv_weight}), "markov_rank": d.markov_rank,
                    "confidence_head": d.confidence_head, "confidence_weight": d.confidence_weight})
    return job


def _side(runs: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    s = statistics.median(r["s"] for r in runs)
    return {"s_per_step": s, "tokens_per_s": tokens / s, "runs_s": [r["s"] for r in runs],
            "loss_rows": runs[-1]["rows"], "losses": [r["loss"] for r in runs]}


def _reset_peak_rss() -> None:
    """Restart this process's peak-RSS count (Linux: VmHWM), so each row reports its own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> int:
    """This process's peak RSS in bytes since the last reset (VmHWM), or over its life (ru_maxrss) elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_dtypes(name: str, ours: dict[str, str], theirs: dict[str, str], *, mixed: bool) -> bool:
    """Whether the row is mixed: the parts (``DTYPE_PARTS``) whose compute dtype differs between the sides. A
    difference refuses the row (``ValueError``, one line) unless ``mixed``, which labels it instead."""
    diff = [f"{p} {ours.get(p)} vs {theirs.get(p)}" for p in DTYPE_PARTS if ours.get(p) != theirs.get(p)]
    if diff and not mixed:
        raise ValueError(f"row {name}: the sides compute at different precisions (tapdraft vs peer: "
                         f"{'; '.join(diff)}); run both at one --precision, or pass --mixed for a labelled mixed row")
    return bool(diff)


def catch_up(spent: dict[str, float], steps: dict[str, Callable[[], dict[str, Any]]], cap: int) -> tuple[str, int]:
    """The side that spent less time on its timed steps takes more steps until its seconds reach the other side's
    (at most ``cap``, so a side whose steps stopped taking time cannot run away); returns (that side, its extra steps).
    ``spent`` is updated in place."""
    fast, slow = sorted(spent, key=spent.get)
    extra = 0
    while spent[fast] < spent[slow] and extra < cap:
        spent[fast] += steps[fast]()["s"]
        extra += 1
    return fast, extra


def per_weight(doc: dict[str, Any]) -> dict[str, Any]:
    """A peer's step or held-out document with ``weighted_loss`` added where it reports ``weight``: speculators'
    DFlash-family loss is sum(w l) / rows, tapdraft's sum(w l) / sum(w), so its loss x rows / weight is tapdraft's
    rule. A document without ``weight`` (a loss already normalised as tapdraft's) is returned as it is."""
    if "weight" not in doc:
        return doc
    return {**doc, "weighted_loss": doc["loss"] * doc["rows"] / doc["weight"]}


def spread(ratios: list[float]) -> dict[str, float]:
    """The per-pair ratios' median, min and max (the table's spread)."""
    if not ratios:
        raise ValueError("no timed pairs: --pairs must be at least 1")
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "pairs": len(ratios)}


def run_row(name: str, args: argparse.Namespace, work: Path, python: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Build ``name``'s data, both sides, then warm-up steps, interleaved timed pairs and the held-out loss of each
    side; returns the row and the peer's library versions."""
    row = ROW_SPECS[name]
    peer_key, peer_name = row.peer, PEERS[row.peer]
    ours_p, theirs_p = args.precision, args.peer_precision or args.precision
    if ours_p != theirs_p and not args.mixed:
        raise ValueError(f"row {name}: --precision {ours_p} against --peer-precision {theirs_p} is a mixed row; "
                         f"pass --mixed to run it labelled as one")
    tag = f"{args.samples}+{args.heldout}x{args.tokens}"
    data = build_dataset(work / f"dataset-{row.family}-{tag}", samples=args.samples + args.heldout,
                         tokens=args.tokens, family=row.family)
    if row.peer == "speculators":
        conv = to_speculators(data, work / f"speculators-{row.family}-{tag}-{theirs_p}", family=row.family,
                              dtype=theirs_p)
    else:
        conv = to_modelopt(data, work / f"modelopt-{row.family}-{tag}-{theirs_p}", family=row.family, dtype=theirs_p)
    mask = conv["vocab_size"] - 1  # the samples' ids stop below it
    if row.peer == "speculators" and "ce" in row.loss.split("+"):  # its CE's label: the teacher's argmax; ours: token
        for p in dict.fromkeys((ours_p, theirs_p)):
            if (a := argmax_agreement(data, p)) < 1.0:
                raise ValueError(f"row {name}: the teacher's argmax ({p}) equals only {a:.1%} of the dataset's "
                                 f"supervised tokens, so the two CE losses would train different labels")
    _reset_peak_rss()
    tap = TapdraftSide(data, row, anchors=args.anchors, samples=args.samples, tokens=args.tokens, mask_token_id=mask,
                       precision=ours_p, heldout=args.heldout)
    if row.peer == "speculators":
        job = speculators_job(conv, tap.run, anchors=args.anchors, samples=args.samples, mask_token_id=mask, row=row)
    else:
        job = modelopt_job(conv, tap.run, anchors=args.anchors, tokens=args.tokens, mask_token_id=mask, row=row,
                           samples=args.samples)
    peer = ModelOptSide(python, job, work / name, peer=row.peer)
    print(f"{name}: trainable parameters tapdraft {tap.trainable:,}  {peer_name} {peer.ready['trainable_params']:,}; "
          f"taps {conv['target_layer_ids']} ({peer_name} {peer.ready['target_layer_ids']})", flush=True)
    # the held-out loss before any step: what each side's measure reads from the inits alone (rows, anchors and
    # inits differ), so the columns after training read as this plus what the steps learned
    start = {"tapdraft": tap.heldout_loss(), peer_key: peer.ask("heldout")} if args.heldout else {}
    first = {"tapdraft": [tap.step() for _ in range(args.warmup)],
             peer_key: [peer.step() for _ in range(args.warmup)]}
    dtypes = {"tapdraft": first["tapdraft"][0]["dtypes"], peer_key: first[peer_key][0]["dtypes"]}
    try:
        mixed = check_dtypes(name, dtypes["tapdraft"], dtypes[peer_key], mixed=args.mixed)
    except ValueError:
        peer.close()
        raise
    runs: dict[str, list[dict[str, Any]]] = {"tapdraft": [], peer_key: []}
    loads = []
    for i in range(args.pairs):
        runs["tapdraft"].append(tap.step())
        runs[peer_key].append(peer.step())
        loads.append(os.getloadavg()[0])
        print(f"{name} pair {i + 1}/{args.pairs}: tapdraft {runs['tapdraft'][-1]['s']:.2f} s  "
              f"{peer_name} {runs[peer_key][-1]['s']:.2f} s  load {loads[-1]:.1f}", flush=True)
    held = {"tapdraft": tap.heldout_loss(), peer_key: peer.ask("heldout")} if args.heldout else {}
    equal_time = None
    if args.heldout:  # then the faster side trains on for the slower side's seconds: a faster step that learns less
        spent = {k: sum(r["s"] for r in v) for k, v in runs.items()}  # cannot lead on the loss
        fast, extra = catch_up(spent, {"tapdraft": tap.step, peer_key: peer.step}, cap=4 * args.pairs)
        loss = tap.heldout_loss() if fast == "tapdraft" else peer.ask("heldout")
        loss = per_weight(loss)
        equal_time = {"side": fast, "extra_steps": extra, "seconds": spent, "heldout": loss}
        print(f"{name}: {PEERS.get(fast, fast)} took {extra} more steps to spend the other side's "
              f"{spent[fast]:.1f} s", flush=True)
    peak_peer = peer.close()["peak_rss"]
    peak_tap = _peak_rss()
    theirs = {**_side(runs[peer_key], tap.tokens), "peak_rss_bytes": peak_peer,
              "trainable_params": peer.ready["trainable_params"], "first_loss": first[peer_key][0]["loss"],
              "dtypes": dtypes[peer_key], "draft_params": peer.ready["dtype"].removeprefix("torch."),
              "heldout": held.get(peer_key), "heldout_start": start.get(peer_key)}
    if row.peer == "speculators":
        theirs["attention"] = peer.ready["attn"]
    if "weight" in first[peer_key][0]:  # a per-row loss (speculators' DFlash and DSpark): also at tapdraft's rule
        theirs.update(weighted_losses=[per_weight(r)["weighted_loss"] for r in runs[peer_key]],
                      first_weighted_loss=per_weight(first[peer_key][0])["weighted_loss"],
                      anchors=runs[peer_key][-1]["anchors"])
        for key, h in (("heldout", held.get(peer_key)), ("heldout_start", start.get(peer_key))):
            if h:
                theirs[key] = per_weight(h)
    sides = {"tapdraft": {**_side(runs["tapdraft"], tap.tokens), "peak_rss_bytes": peak_tap,
                          "trainable_params": tap.trainable, "first_loss": first["tapdraft"][0]["loss"],
                          "dtypes": dtypes["tapdraft"], "draft_params": tap.draft_params(),
                          "heldout": held.get("tapdraft"), "heldout_start": start.get("tapdraft")},
             peer_key: theirs}
    d = tap.run.drafter
    # the soft-CE offset: ModelOpt's distillation loss = tapdraft's KL + H(p) per step weight (teacher_entropy);
    # speculators' kl_div is the KL itself
    weights = sum(d.step_decay**j for j in range(d.num_steps)) if row.family == "eagle3" else 1.0
    soft_ce = row.loss in ("kd", "kl") and row.peer == "modelopt"  # DSpark's L1 is the same value on both
    offset = teacher_entropy(data, indices=range(args.samples)) * weights if soft_ce else 0.0
    held_offset = teacher_entropy(data, indices=range(args.samples, args.samples + args.heldout)) * weights \
        if soft_ce and args.heldout else 0.0
    shape = ({"ttt_steps": d.num_steps, "step_decay": d.step_decay, "draft_vocab": "full", "qk_norm": d.qk_norm,
              "train_lm_head": d.train_lm_head} if row.family == "eagle3" else {"anchors_per_seq": args.anchors})
    anchors = ("none: every supervised row each step" if row.family == "eagle3" else
               f"fresh each step on both sides, drawn independently ({peer_name}'s sampler takes no given anchors)")
    ratios = [m["s"] / t["s"] for m, t in zip(runs[peer_key], runs["tapdraft"])]
    return {"row": name, "family": row.family, "loss": row.loss, "peer": peer_key, **shape, "tokens": tap.tokens,
            "taps": conv["target_layer_ids"], "peer_taps": peer.ready["target_layer_ids"],
            "precision": {"tapdraft": ours_p, peer_key: theirs_p}, "mixed": mixed, "anchors": anchors,
            "heldout_samples": args.heldout, "trainable_equal": tap.trainable == peer.ready["trainable_params"],
            **sides, "peer_loss_offset": offset, "peer_heldout_offset": held_offset,
            "peer_over_tapdraft": statistics.median(ratios), "ratios": ratios, "ratio_spread": spread(ratios),
            "heldout_equal_time": equal_time, "load_avg_1m": loads}, peer.ready["versions"]


def _label(row: dict[str, Any]) -> str:
    spec = ROW_SPECS[row["row"]]
    mixed = "MIXED precision: " if row.get("mixed") else ""
    if row["family"] == "eagle3":
        return f"{mixed}{spec.label}, {row['ttt_steps']} steps, full vocabulary"
    return f"{mixed}{spec.label}, {row['anchors_per_seq']} anchors/seq"


def _peer_loss(side: dict[str, Any], key: str = "losses") -> str:
    """The peer's last loss per row (``key`` losses) or held-out loss (heldout, heldout_start) as tapdraft normalises
    it (speculators: its own figure in brackets)."""
    if key != "losses":
        h = side.get(key)
        if not h:
            return "-"
        return f"{h['weighted_loss']:.3f} [own {h['loss']:.3f}]" if "weighted_loss" in h else f"{h['loss']:.3f}"
    if "weighted_losses" in side:
        return f"{side['weighted_losses'][-1]:.3f} [own {side['losses'][-1]:.3f}]"
    return f"{side['losses'][-1]:.3f}"


def _equal_time(row: dict[str, Any]) -> str:
    """The held-out losses after equal seconds: the faster side's after its extra steps (``+k``), the slower side's
    after the pairs (tapdraft's with the soft-CE offset a ModelOpt KD row adds)."""
    eq = row.get("heldout_equal_time")
    if not eq:
        return "-"
    t, m = row["tapdraft"], row[row["peer"]]
    fast_t = eq["side"] == "tapdraft"
    hh = row["peer_heldout_offset"]
    ours = (eq["heldout"] if fast_t else t["heldout"])["loss"]
    theirs = _peer_loss({"heldout": eq["heldout"]} if not fast_t else m, "heldout")
    ours_txt = f"{ours:.3f}" + (f" (+{hh:.2f} = {ours + hh:.3f})" if hh else "")
    k = f" +{eq['extra_steps']} steps"
    return f"{ours_txt}{k if fast_t else ''} / {theirs}{'' if fast_t else k}"


def _dtypes(side: dict[str, Any]) -> str:
    d = side["dtypes"]
    return "/".join(d[p] for p in DTYPE_PARTS) + f" (params {side['draft_params']})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"comma-separated rows to run, of {', '.join(ROW_SPECS)} (default: the ModelOpt rows)")
    ap.add_argument("--pairs", type=int, default=7, help="interleaved tapdraft / peer step pairs (5 at least for a "
                                                         "median worth reading)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first (at least 1)")
    ap.add_argument("--anchors", type=int, default=32, help="DFlash anchors (blocks) per sequence on both sides")
    ap.add_argument("--samples", type=int, default=2, help="samples in the micro-batch")
    ap.add_argument("--heldout", type=int, default=2, help="samples held out for the held-out loss (0: none)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per sample (a multiple of the block, 16)")
    ap.add_argument("--precision", default="bfloat16", choices=PRECISIONS,
                    help="both sides' precision: bfloat16 (the peers' default on real checkpoints: ModelOpt's bf16 "
                         "base, speculators' bf16 autocast; tapdraft's bf16 head and autocast) or float32 (control)")
    ap.add_argument("--peer-precision", default=None, choices=PRECISIONS,
                    help="the peer's precision when it differs from --precision (needs --mixed)")
    ap.add_argument("--mixed", action="store_true",
                    help="run a row whose sides compute at different precisions, labelled mixed, instead of refusing")
    ap.add_argument("--workdir", default="/tmp/tapdraft-peers", help="where the datasets and their conversions live")
    ap.add_argument("--name", default="peers.json", help="result file in benchmarks/results/")
    args = ap.parse_args(argv)
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in names if r not in ROW_SPECS]
    if unknown or not names:
        raise ValueError(f"--rows: unknown {unknown}; choose from {', '.join(ROW_SPECS)}")
    if args.tokens % BLOCK:
        raise ValueError(f"--tokens must be a multiple of the block size {BLOCK} (ModelOpt refuses others)")
    if args.pairs < 1 or args.warmup < 1 or args.heldout < 0:
        raise ValueError("--pairs and --warmup must be at least 1 (the first step's dtypes are checked), --heldout "
                         "at least 0")
    if args.pairs < 5:
        warnings.warn(f"--pairs {args.pairs}: a median of fewer than 5 pairs is a smoke test, not a figure")
    torch.set_num_threads(1)
    work = Path(args.workdir)
    pythons = {p: peer_python(PEER_VENV[p]) for p in dict.fromkeys(ROW_SPECS[n].peer for n in names)}
    rows, versions = [], {}
    for name in names:
        row, versions[ROW_SPECS[name].peer] = run_row(name, args, work, pythons[ROW_SPECS[name].peer])
        rows.append(row)
    n = args.warmup + args.pairs
    print(f"\n| row | peer | dtypes head/embedding/draft tapdraft ; peer | tapdraft s/step | peer s/step | "
          f"peer / tapdraft: median (min-max, pairs) | tokens/s tapdraft / peer | peak RSS tapdraft / peer | "
          f"loss/row after {n} steps tapdraft (+ H(p) offset) / peer | held-out loss after {n} steps tapdraft / "
          f"peer | held-out loss after equal seconds tapdraft / peer | held-out loss before the first step tapdraft / "
          f"peer | trainable params | load |")
    for r in rows:
        t, m = r["tapdraft"], r[r["peer"]]
        h = r["peer_loss_offset"]
        off = f" (+{h:.2f} = {t['losses'][-1] + h:.3f})" if h else ""
        hh = r["peer_heldout_offset"]
        hoff = f" (+{hh:.2f} = {t['heldout']['loss'] + hh:.3f})" if hh and t.get("heldout") else ""
        held = f"{t['heldout']['loss']:.3f}{hoff} / {_peer_loss(m, 'heldout')}" if t.get("heldout") else "-"
        s0 = t.get("heldout_start")
        held0 = f"{s0['loss'] + hh:.3f} / {_peer_loss(m, 'heldout_start')}" if s0 else "-"
        params = f"{t['trainable_params']:,}" + ("" if r["trainable_equal"] else f" / {m['trainable_params']:,}")
        eq = _equal_time(r)
        sp = r["ratio_spread"]
        print(f"| {_label(r)} ({t['loss_rows']} / {m['loss_rows']} rows) | {PEERS[r['peer']]} | "
              f"{_dtypes(t)} ; {_dtypes(m)}{' MIXED' if r['mixed'] else ''} | "
              f"{t['s_per_step']:.2f} | {m['s_per_step']:.2f} | "
              f"{sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f}, {sp['pairs']}) | "
              f"{t['tokens_per_s']:.0f} / {m['tokens_per_s']:.0f} | "
              f"{t['peak_rss_bytes'] / 2**30:.2f} / {m['peak_rss_bytes'] / 2**30:.2f} GiB | "
              f"{t['losses'][-1]:.3f}{off} / {_peer_loss(m)} | {held} | {eq} | {held0} | {params} | "
              f"{min(r['load_avg_1m'], default=0):.1f}-{max(r['load_avg_1m'], default=0):.1f} |")
    for r in rows:
        print(f"{r['row']}: anchors {r['anchors']}; trainable weights tapdraft {r['tapdraft']['draft_params']}, "
              f"{PEERS[r['peer']]} {r[r['peer']]['draft_params']}{'; MIXED precision' if r['mixed'] else ''}")
    doc = {"benchmark": "peers", "shape": SHAPE, **shape_facts(SHAPE), "block_size": BLOCK, "gamma": GAMMA,
           "draft_layers": DRAFT_LAYERS, "ttt_steps": TTT_STEPS, "step_decay": STEP_DECAY, "samples": args.samples,
           "heldout_samples": args.heldout, "tokens_per_sample": args.tokens, "warmup": args.warmup,
           "pairs": args.pairs, "threads": 1, "precision": args.precision,
           "peer_precision": args.peer_precision or args.precision, "mixed": any(r["mixed"] for r in rows),
           "rows": rows, "peer_versions": versions}
    write_result(args.name, doc)
    return doc


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        raise SystemExit(f"error: {e}")
