"""vLLM plugin: what stock vLLM lacks to serve tapdraft's drafters (beside speech-LLM targets, MTP heads, candidate
heads on a CPU).

Install it into the vLLM venv (``pip install engines/vllm_plugin``); vLLM loads it in every process
through the ``vllm.general_plugins`` entry point, before any model is built. Four fixes, each for an
upstream gap in vLLM 0.32 (read from its source):

1. ``llm_base_proposer.SpecDecodeBaseProposer.load_model`` copies the target's ``image_token_index``
   into the draft's config for every multimodal target not on its list of vision models, so any
   speech target fails before decoding (``'Qwen2AudioConfig' object has no attribute
   'image_token_index'``; Qwen3-ASR's config has no such field either). The fix gives such a target's
   config an ``image_token_index`` equal to its audio placeholder id (``audio_token_index`` /
   ``audio_token_id``), the token whose rows the encoder's frames replace.
2. The drafters that read the target's intermediate layers (DFlash, DFlash2, EAGLE-3) need the target
   class to implement vLLM's ``SupportsEagle3`` interface; Qwen2-Audio's, Voxtral's and Granite
   Speech's do not (``Model does not support EAGLE3 interface but aux_hidden_state_outputs was
   requested``), although their language models do. The fix adds the interface to those classes: it
   delegates to the language model, as the interface's own default methods already do.
3. ``method: "mtp"`` builds a drafter only from a module named by the *target's* architecture, so a bolt-on MTP
   head over a dense target (tapdraft's ``mtp`` family) has no class. The plugin registers one
   (``TapdraftMTPForCausalLM``, ``tapdraft_vllm.mtp``) and routes an export that names it
   (``--layout tapdraft-vllm``) to vLLM's MTP path (``SpeculativeConfig.hf_config_override``).
4. DFlash2 and LiLiCorr are drafted only by vLLM's V2 runner (Triton: not on a CPU); V1 refuses them ("DFlash
   candidate-head drafts"). The plugin gives V1's ``DFlashProposer`` their sampling step (the model's candidates
   and its selector or LiLiCorr head, then the greedy walk; ``tapdraft_vllm.candidate_heads``) and lifts that
   refusal for those two architectures.

Each fix is applied only where stock vLLM still lacks it, so a vLLM that has fixed one upstream is left
alone. ``SUPPORTED`` is the vLLM range this was proven on; outside it, loading refuses in one line.
"""

from __future__ import annotations

SUPPORTED = ((0, 32), (0, 33))
"""[low, high) of vLLM (major, minor) versions these fixes were checked against."""

SPEECH_CLASSES = (
    ("vllm.model_executor.models.qwen2_audio", "Qwen2AudioForConditionalGeneration"),
    ("vllm.model_executor.models.voxtral", "VoxtralForConditionalGeneration"),
    ("vllm.model_executor.models.granite_speech", "GraniteSpeechForConditionalGeneration"),
)
"""Speech-target classes whose language model supports EAGLE-3 aux states but which do not declare it."""

AUDIO_TOKEN_FIELDS = ("audio_token_index", "audio_token_id")

MTP_ARCHITECTURE = "TapdraftMTPForCausalLM"
"""The architecture a ``tapdraft-vllm`` MTP export names (``train/drafters/mtp/export.py``)."""
MTP_MODEL_TYPE = "mtp"
"""The generic entry of vLLM's ``MTPModelTypes``: the draft's model type its MTP path accepts."""

_APPLIED: list[str] = []
_OVERRIDE: list = []  # vLLM's own SpeculativeConfig.hf_config_override, once wrapped


def check_version(version: str) -> None:
    """Refuse a vLLM outside ``SUPPORTED`` (the fixes patch its internals by name)."""
    parts = version.split(".")
    try:
        mm = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        raise RuntimeError(f"tapdraft-vllm: cannot read vLLM's version {version!r}") from None
    lo, hi = SUPPORTED
    if not lo <= mm < hi:
        raise RuntimeError(
            f"tapdraft-vllm supports vLLM {lo[0]}.{lo[1]}.x up to (not including) {hi[0]}.{hi[1]}, found {version}: "
            "install a vLLM in that range, or uninstall tapdraft-vllm (pip uninstall tapdraft-vllm) and check "
            "whether this vLLM serves speech targets with a draft by itself")


def audio_token_id(config) -> int | None:
    """The audio placeholder token id of a speech target's HF config (top level or its thinker's)."""
    for cfg in (config, getattr(config, "thinker_config", None)):
        for name in AUDIO_TOKEN_FIELDS:
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, int):
                return value
    return None


def _fix_image_token_index() -> None:
    from vllm.v1.spec_decode import llm_base_proposer

    cls = llm_base_proposer.SpecDecodeBaseProposer
    original = cls.load_model
    if getattr(original, "_tapdraft", False):
        return

    def load_model(self, target_model, *args, **kwargs):
        config = getattr(target_model, "config", None)
        if config is not None and not hasattr(config, "image_token_index"):
            token = audio_token_id(config)
            if token is not None:
                config.image_token_index = token
        return original(self, target_model, *args, **kwargs)

    load_model._tapdraft = True
    cls.load_model = load_model
    _APPLIED.append("image_token_index")


def _fix_eagle3_interface() -> None:
    import importlib

    from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3

    for module, name in SPEECH_CLASSES:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if supports_eagle3(cls):
            continue
        # every member of the protocol, with the protocol's own defaults (flags and the two delegating methods)
        for member in sorted(_protocol_members(SupportsEagle3)):
            if not hasattr(cls, member):
                setattr(cls, member, getattr(SupportsEagle3, member))
        cls.supports_eagle3 = True
        assert supports_eagle3(cls), name
        _APPLIED.append(f"SupportsEagle3:{name}")


def _protocol_members(proto) -> set[str]:
    """The members ``isinstance`` checks for a runtime-checkable protocol (Python 3.12+ stores them)."""
    import typing

    members = getattr(proto, "__protocol_attrs__", None)
    return set(members) if members is not None else set(typing._get_protocol_attrs(proto))


def mtp_config_override(hf_config):
    """vLLM's draft-config override, with tapdraft's MTP exports routed to the plugin's class: their config is a
    Qwen3 block's (``model_type: qwen3``), which vLLM's MTP path does not know; it becomes a generic MTP draft with
    ``n_predict`` physical layers. Every other config goes to vLLM's own override. Module level: vLLM pickles it."""
    if MTP_ARCHITECTURE in (getattr(hf_config, "architectures", None) or []):
        hf_config.model_type = MTP_MODEL_TYPE
        hf_config.update({"n_predict": int(getattr(hf_config, "num_nextn_predict_layers", 1))})
        return hf_config
    return _OVERRIDE[0](hf_config)


def _serve_mtp_heads() -> None:
    from vllm import ModelRegistry
    from vllm.config.speculative import SpeculativeConfig

    if MTP_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MTP_ARCHITECTURE, "tapdraft_vllm.mtp:TapdraftMTPForCausalLM")
    if SpeculativeConfig.hf_config_override is not mtp_config_override:
        _OVERRIDE[:] = [SpeculativeConfig.hf_config_override]
        SpeculativeConfig.hf_config_override = staticmethod(mtp_config_override)
        _APPLIED.append(f"mtp:{MTP_ARCHITECTURE}")


def _serve_candidate_heads_in_v1() -> None:
    from tapdraft_vllm import candidate_heads

    if candidate_heads.install() and "candidate_heads:v1" not in _APPLIED:
        _APPLIED.append("candidate_heads:v1")


def register() -> None:
    """vLLM's plugin hook (may run several times in one process: each fix applies once)."""
    import vllm

    check_version(vllm.__version__)
    _fix_image_token_index()
    _fix_eagle3_interface()
    _serve_mtp_heads()
    _serve_candidate_heads_in_v1()


def applied() -> list[str]:
    """The fixes this process applied (for tests and logs)."""
    return list(_APPLIED)
