"""The schema of the target's config values: the one home of what a bundle may say about its target, checked
before a bundle is written, when it is loaded, and again when an export repeats those values.

Why: bundle.json is data someone else wrote, and its values flow into a draft's ``config.json``, which a serving
engine trusts as it stands: a context length, the attention kind of every layer, RoPE settings, head counts. A
value of the wrong type or range trained an MTP draft with zero attention heads and exported it as servable, a
string ``hidden_size`` ended in a traceback, and any string in ``layer_types`` was written into the export. The
checksums (``shards.bundle``, the manifest's record of bundle.json) say the bytes are the ones written; this says
the values are ones a target can have.

    field                    rule (JSON types: an integer is never true/false, never 4096.0); null allowed but
                             for the three REQUIRED fields, which every reader of a bundle uses. The numbers are
                             the widths of the one table of dataset bounds (``shards.limits``, with real sizes)
    model_type               a name: letters, digits, ``_ . -``, 1-64 characters
    hidden_size              integer in [1, 131072]                 required
    num_hidden_layers        integer in [1, 4096]                   required
    vocab_size               integer in [1, 16777216]               required
    num_attention_heads      integer in [1, 4096]
    num_key_value_heads      integer in [1, 4096]; divides num_attention_heads
    head_dim                 integer in [1, 8192]; when null, num_attention_heads divides hidden_size (a drafter
                             then takes head_dim = hidden_size / heads: ``train.drafters.base.layer_shape``)
    intermediate_size        integer in [1, 1048576] and at most 16 x hidden_size (no weight backs this width: a
                             bundle claiming 2,000,000 over hidden 64 allocated 3.2 GB of draft MLP)
    rope_theta               finite number > 0
    rms_norm_eps             finite number in (0, 1)
    logits_scaling           finite number > 0
    bos/pad_token_id         integer in [-1, 16777216]
    eos_token_id             the same, or a non-empty list of them
    max_position_embeddings  integer in [1, 1073741824]
    layer_types              null, or a list of LAYER_TYPES names, one per layer (num_hidden_layers of them)
    rope_parameters          null, or a RoPE object (``rope_type`` one of ROPE_TYPES; ``rope_theta`` > 0; every
                             other value a finite number, true/false, null or a list of finite numbers), or an
                             object of such RoPE objects keyed by LAYER_TYPES names (Gemma 3)

``check_target_config`` applies the rules to a bundle's config (the required fields must be there);
``check_fields`` to any object of such fields (a drafter's layer shape over the bundle's);
``check_export_config`` applies the same rules to every object of an export's config, wherever a layout nests
them (``transformer_layer_config``, ``llm``), with ``rope_scaling`` read as ``rope_parameters`` and
``target_layer_types`` as ``layer_types``. A refusal is one ``ValueError`` line naming the file, the field, the
value and the bound. The names mirror transformers 5.25 (``configuration_utils.ALLOWED_LAYER_TYPES`` with its
legacy names, ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` plus ``default``); they are declared here, never
imported, so a newer library cannot widen what an export may say.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Mapping

from tapdraft.shards.limits import (MAX_FFN_RATIO, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS,
                                    MAX_POSITIONS, MAX_VOCAB)

LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "window_attention", "indexed_attention",
    "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse", "conv", "moe", "hybrid",
    "hybrid_sliding", "reference_sliding_attention", "linear_attention", "sparse", "dense",
    "mamba", "attention", "deepseek_sparse_attention", "qwen_sparse_attention",  # names older configs use
)
"""What one entry of ``layer_types`` may be."""
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional", "axial", "mrope")
"""What ``rope_parameters.rope_type`` may be."""
REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size")
"""Fields a bundle's config must hold with a value (the dataset's layout and the bundle's weights are checked against
them); a drafter that needs more asks for it where it reads it (``layer_shape``: the heads)."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_ID = MAX_VOCAB
MAX_DEPTH = 8
"""How deep ``check_export_config`` walks (an export's config nests two levels)."""


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value).encode("ascii", "backslashreplace").decode()
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int_in(lo: int, hi: int, nullable: bool = False) -> tuple[Callable[[Any], bool], str]:
    bound = f"an integer in [{lo}, {hi}]" + (" or null" if nullable else "")
    return (lambda v: (nullable and v is None) or (_is_int(v) and lo <= v <= hi)), bound


def _positive() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v is None or (_is_number(v) and v > 0)), "a finite number > 0 or null"


def _token_id(v: Any) -> bool:
    return v is None or (_is_int(v) and -1 <= v <= MAX_ID)


def _layer_types(v: Any) -> bool:
    return v is None or (isinstance(v, list) and 0 < len(v) <= MAX_LAYERS and all(x in LAYER_TYPES for x in v))


def _rope_object(v: Any) -> bool:
    if not isinstance(v, dict) or len(v) > 32:
        return False
    for key, x in v.items():
        if not isinstance(key, str) or not _KEY.match(key):
            return False
        if key in ("rope_type", "type"):
            ok = x in ROPE_TYPES
        elif key == "rope_theta":
            ok = _is_number(x) and x > 0
        else:
            ok = (x is None or isinstance(x, bool) or _is_number(x)
                  or (isinstance(x, list) and len(x) <= 4096 and all(_is_number(y) for y in x)))
        if not ok:
            return False
    return True


def _rope(v: Any) -> bool:
    if v is None or _rope_object(v):
        return True
    return isinstance(v, dict) and 0 < len(v) <= len(LAYER_TYPES) and all(
        k in LAYER_TYPES and _rope_object(x) for k, x in v.items())


RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model_type": (lambda v: v is None or (isinstance(v, str) and bool(_NAME.match(v))),
                   "a name of letters, digits, '_', '.' or '-' (1-64 characters) or null"),
    "hidden_size": _int_in(1, MAX_HIDDEN),
    "num_hidden_layers": _int_in(1, MAX_LAYERS),
    "vocab_size": _int_in(1, MAX_VOCAB),
    "num_attention_heads": _int_in(1, MAX_HEADS, nullable=True),
    "num_key_value_heads": _int_in(1, MAX_HEADS, nullable=True),
    "head_dim": _int_in(1, MAX_HEAD_DIM, nullable=True),
    "intermediate_size": _int_in(1, MAX_INTERMEDIATE, nullable=True),
    "rope_theta": _positive(),
    "rms_norm_eps": (lambda v: v is None or (_is_number(v) and 0 < v < 1), "a finite number in (0, 1) or null"),
    "logits_scaling": _positive(),
    "bos_token_id": (_token_id, f"an integer in [-1, {MAX_ID}] or null"),
    "pad_token_id": (_token_id, f"an integer in [-1, {MAX_ID}] or null"),
    "eos_token_id": (lambda v: _token_id(v) or (isinstance(v, list) and 0 < len(v) <= 64
                                                and all(x is not None and _token_id(x) for x in v)),
                     f"an integer in [-1, {MAX_ID}], a non-empty list of them, or null"),
    "max_position_embeddings": _int_in(1, MAX_POSITIONS, nullable=True),
    "layer_types": (_layer_types, f"null or a list of known layer kinds (one of {', '.join(LAYER_TYPES[:4])}, ...: "
                                  "shards.target_config.LAYER_TYPES)"),
    "rope_parameters": (_rope, f"null or a RoPE object (rope_type one of {'/'.join(ROPE_TYPES)}, rope_theta > 0, "
                               "other values finite numbers, true/false or lists of numbers)"),
}
"""Field -> (test, the bound a refusal states)."""
ALIASES = {"rope_scaling": "rope_parameters", "target_layer_types": "layer_types"}
"""Export keys that carry a target field under another name."""


def _refuse(where: str, field: str, value: Any, bound: str, todo: str) -> ValueError:
    return ValueError(f"{where}: {field} = {_show(value)} is not {bound}; {todo}")


def check_fields(doc: Mapping[str, Any], where: str, todo: str, prefix: str = "") -> None:
    """The rules of every field ``doc`` holds (under its own name or an alias), then the rules across fields; one
    ValueError line naming ``where``, the field (after ``prefix``), its value and the bound, then ``todo``."""
    for key, value in doc.items():
        rule = RULES.get(ALIASES.get(key, key)) if isinstance(key, str) else None
        if rule is not None and not rule[0](value):
            raise _refuse(where, prefix + key, value, rule[1], todo)
    heads, kv, hidden = doc.get("num_attention_heads"), doc.get("num_key_value_heads"), doc.get("hidden_size")
    if _is_int(heads) and _is_int(kv) and heads % kv:
        raise _refuse(where, prefix + "num_key_value_heads", kv, f"a divisor of num_attention_heads ({heads})", todo)
    if _is_int(heads) and _is_int(hidden) and doc.get("head_dim") is None and hidden % heads:
        raise _refuse(where, prefix + "hidden_size", hidden, f"a multiple of num_attention_heads ({heads}), as "
                      "head_dim is not given (head_dim = hidden_size / heads)", todo)
    inter = doc.get("intermediate_size")
    if _is_int(inter) and _is_int(hidden) and inter > MAX_FFN_RATIO * hidden:
        raise _refuse(where, prefix + "intermediate_size", inter, f"at most {MAX_FFN_RATIO} x hidden_size ({hidden}): "
                      "real targets use 2.5-8x", todo)
    types, layers = doc.get("layer_types"), doc.get("num_hidden_layers")
    if isinstance(types, list) and _is_int(layers) and len(types) != layers:
        raise _refuse(where, prefix + "layer_types", types, f"one entry per layer (num_hidden_layers = {layers}, it "
                      f"has {len(types)})", todo)


def check_target_config(config: Any, where: str, todo: str) -> None:
    """Refuse a bundle's target config (``where``: the file or source named in the message) that breaks a rule, in
    one ValueError line naming the field, its value and the bound, then ``todo``."""
    if not isinstance(config, dict):
        raise _refuse(where, "config", config, "an object", todo)
    for key in REQUIRED:
        if config.get(key) is None:
            raise _refuse(where, key, config.get(key), RULES[key][1], todo)
    check_fields(config, where, todo)


def check_export_config(cfg: Any, where: str, todo: str) -> None:
    """Apply the rules to every object of an export's config (``where``: what it was built from) before it is
    written: a value a bundle passed through a drafter is checked where a serving engine will read it."""
    def walk(node: Any, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ValueError(f"{where}: the export config nests deeper than {MAX_DEPTH} levels at {prefix or 'top'}; "
                             f"{todo}")
        if isinstance(node, dict):
            check_fields(node, where, todo, prefix)
            for key, value in node.items():
                if isinstance(value, (dict, list)) and ALIASES.get(key, key) not in RULES:
                    walk(value, f"{prefix}{key}.", depth + 1)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, (dict, list)):
                    walk(value, f"{prefix}{i}.", depth + 1)

    walk(cfg, "", 0)
