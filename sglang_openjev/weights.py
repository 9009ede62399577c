"""Checkpoint weight names of a Transformers Qwen3.5 classifier -> the SGLang adapter's modules,
and the strict-loading checks both backends apply.

Pure functions (no torch, no sglang), so the mapping and the checks are tested everywhere.

Transformers' `Qwen3_5ForSequenceClassification` is `GenericForSequenceClassification` over the
multimodal `Qwen3_5Model`, so its state dict reads

    model.language_model.{embed_tokens,layers.N.*,norm}.*   the text backbone
    model.visual.*                                          the vision tower (unused for text)
    score.weight                                            nn.Linear(hidden, num_labels, bias=False)

and `Qwen3_5TextForSequenceClassification` (text-only `Qwen3_5TextModel`) puts the backbone
directly under `model.`. A checkpoint converted from a causal LM may also carry `lm_head.*` and
the multi-token-prediction head `mtp.*`.

The adapter holds SGLang's own text backbone (`sglang.srt.models.qwen3_5.Qwen3_5ForCausalLM`,
which despite its name has no LM head) as `self.model`. Its `load_weights` takes names relative
to itself (`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`, ...) and does the fused
q/k/v, gate/up and GDN in_proj_{qkv,z,b,a} stacking itself, so the adapter only strips the
prefix and routes the head.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable, NamedTuple

BACKBONE = "backbone"   # hand to the SGLang backbone's load_weights under `name`
HEAD = "head"           # the classification head `score`; `name` is the parameter (weight/bias)
SKIP = "skip"           # not used by a text classifier; `name` says why
UNEXPECTED = "unexpected"  # not a Qwen3.5 classifier weight at all

# Longest prefix first: "model.language_model." must win over "model.".
BACKBONE_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
SKIPPED_PREFIXES = {
    "lm_head.": "the classifier has no language-model head",
    "model.visual.": "the text classifier runs the language backbone only",
    "visual.": "the text classifier runs the language backbone only",
    "mtp.": "multi-token-prediction head, unused by a classifier",
    "model.mtp.": "multi-token-prediction head, unused by a classifier",
}
HEAD_PREFIX = "score."


class Route(NamedTuple):
    kind: str
    name: str


def route_weight(name: str) -> Route:
    """Where checkpoint tensor `name` goes."""
    if name.startswith(HEAD_PREFIX):
        return Route(HEAD, name[len(HEAD_PREFIX):])
    for prefix, why in SKIPPED_PREFIXES.items():
        if name.startswith(prefix):
            return Route(SKIP, why)
    for prefix in BACKBONE_PREFIXES:
        if name.startswith(prefix):
            return Route(BACKBONE, name[len(prefix):])
    return Route(UNEXPECTED, name)


def check_head_weights(loaded: dict[str, tuple[int, ...]], num_labels: int, hidden_size: int) -> None:
    """Refuse a checkpoint whose `score` head is missing, biased or of the wrong shape.

    `loaded` maps the head parameter names seen in the checkpoint to their shapes. Transformers'
    GenericForSequenceClassification head is `nn.Linear(hidden, num_labels, bias=False)`;
    dropping a bias silently would change every logit, so a bias is an error, not a warning.
    """
    if "weight" not in loaded:
        raise ValueError("the checkpoint has no 'score.weight': it is not a sequence-classification "
                         "checkpoint (a causal-LM or base checkpoint has no classifier head)")
    extra = sorted(set(loaded) - {"weight"})
    if extra:
        raise ValueError(f"the checkpoint has score.{', score.'.join(extra)}, but Transformers' "
                         "Qwen3.5 classification head is nn.Linear(hidden, num_labels, bias=False)")
    shape = tuple(loaded["weight"])
    if shape != (num_labels, hidden_size):
        raise ValueError(f"score.weight has shape {list(shape)}, expected [{num_labels}, {hidden_size}] "
                         "(num_labels x hidden_size from the config)")


# ---------------------------------------------------------------- strict loading
# A checkpoint loads only if every tensor the classifier needs is in it exactly once with the
# right shape, and nothing else is, apart from the documented ignored prefixes (SKIPPED_PREFIXES:
# lm_head.*, mtp.*, the vision tower). SGLang ignores the return value of load_weights and its
# sharded weight loaders narrow an oversized tensor without a word, so the adapter checks the
# names and shapes itself against the table below; the embedded backend checks Transformers'
# loading report the same way and formats the refusal with the same function.
LIST_LIMIT = 20  # names shown per problem kind; the count is always exact


def is_ignored(name: str) -> bool:
    """A documented ignored checkpoint tensor (lm_head.*, mtp.*, the vision tower)."""
    return any(name.startswith(prefix) for prefix in SKIPPED_PREFIXES)


def _cfg(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def expected_backbone_shapes(text_config, layer_types: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The text backbone's checkpoint tensors, relative to the backbone, with their full shapes.

    What Transformers' Qwen3.5 text model saves (checked against its real state dict by the
    tests): the checkpoint shapes, independent of SGLang's tensor parallelism and fused
    parameters. `layer_types` is the per-layer "linear_attention" / "full_attention" layout the
    serving model is built with (SGLang's layers_block_type, from full_attention_interval, says
    "attention" for the latter).
    """
    c = lambda k, d=None: _cfg(text_config, k, d)  # noqa: E731
    hidden, inter, vocab = c("hidden_size"), c("intermediate_size"), c("vocab_size")
    heads, kv_heads = c("num_attention_heads"), c("num_key_value_heads")
    head_dim = c("head_dim") or hidden // heads
    gate = 2 if c("attn_output_gate", True) else 1  # Qwen3.5's q_proj also produces the output gate
    nk, nv = c("linear_num_key_heads"), c("linear_num_value_heads")
    dk, dv, kernel = c("linear_key_head_dim"), c("linear_value_head_dim"), c("linear_conv_kernel_dim")
    conv_dim = 2 * nk * dk + nv * dv
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden), "norm.weight": (hidden,)}
    for i, kind in enumerate(layer_types):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                    p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter)})
        if kind in ("full_attention", "attention"):  # SGLang's layers_block_type says "attention"
            a = p + "self_attn."
            out.update({a + "q_proj.weight": (heads * head_dim * gate, hidden),
                        a + "k_proj.weight": (kv_heads * head_dim, hidden),
                        a + "v_proj.weight": (kv_heads * head_dim, hidden),
                        a + "o_proj.weight": (hidden, heads * head_dim),
                        a + "q_norm.weight": (head_dim,), a + "k_norm.weight": (head_dim,)})
            if c("attention_bias", False):
                out.update({a + "q_proj.bias": (heads * head_dim * gate,), a + "k_proj.bias": (kv_heads * head_dim,),
                            a + "v_proj.bias": (kv_heads * head_dim,), a + "o_proj.bias": (hidden,)})
        elif kind == "linear_attention":
            a = p + "linear_attn."
            out.update({a + "in_proj_qkv.weight": (conv_dim, hidden), a + "in_proj_z.weight": (nv * dv, hidden),
                        a + "in_proj_b.weight": (nv, hidden), a + "in_proj_a.weight": (nv, hidden),
                        a + "conv1d.weight": (conv_dim, 1, kernel), a + "dt_bias": (nv,), a + "A_log": (nv,),
                        a + "norm.weight": (dv,), a + "out_proj.weight": (hidden, nv * dv)})
        else:
            raise ValueError(f"layer {i} has type {kind!r}; a Qwen3.5 backbone has linear_attention and "
                             "full_attention layers only")
    return out


def compare_shapes(seen: dict[str, tuple], expected: dict[str, tuple]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, mismatched) of `seen` name -> shape against `expected`.

    `mismatched` entries read "name [checkpoint shape] (expected [shape])".
    """
    missing = sorted(set(expected) - set(seen))
    unexpected = sorted(set(seen) - set(expected))
    mismatched = sorted(f"{name} {list(seen[name])} (expected {list(expected[name])})"
                        for name in set(seen) & set(expected) if tuple(seen[name]) != tuple(expected[name]))
    return missing, unexpected, mismatched


def _listed(kind: str, names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:LIST_LIMIT])
    more = f" ... and {len(names) - LIST_LIMIT} more" if len(names) > LIST_LIMIT else ""
    return f"{len(names)} {kind}: {shown}{more}"


def loading_problems(missing=(), unexpected=(), duplicated=(), mismatched=(), other=()) -> list[str]:
    """One line per problem kind (empty list = the checkpoint loads), names listed."""
    out = []
    for kind, names in (("missing tensor(s)", missing), ("unexpected tensor(s)", unexpected),
                        ("tensor name(s) given more than once", duplicated),
                        ("tensor(s) of the wrong shape", mismatched)):
        if names:
            out.append(_listed(kind, list(names)))
    out.extend(other)
    return out


def refuse_if_problems(problems: list[str], where: str = "") -> None:
    """Raise the refusal (ValueError) listing every problem; nothing when the list is empty."""
    if problems:
        raise ValueError(f"refusing the checkpoint{where}: " + "; ".join(problems) +
                         " (SPEC strict loading: every tensor exactly once with its shape; only lm_head.*, "
                         "mtp.* and the vision tower may be extra)")


def check_checkpoint_names(unexpected: list[str], duplicated: list[str]) -> None:
    """Refuse a checkpoint with tensors that are not a Qwen3.5 classifier's, or a name given twice."""
    refuse_if_problems(loading_problems(unexpected=unexpected, duplicated=duplicated))


def safetensors_header(path: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape from a .safetensors file's header, refusing (ValueError) a file that is not one
    or whose size is not what its header describes (0 bytes, truncated, cut short by a copy)."""
    path = Path(path)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} has {size} bytes: not a safetensors file (no header)")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise ValueError(f"{path.name} has {size} bytes, less than its {length}-byte header: truncated")
        try:
            header = json.loads(fh.read(length))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
            shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in tensors.items()}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise ValueError(f"{path.name}: its header is not a safetensors header") from None
    if 8 + length + end != size:
        raise ValueError(f"{path.name} has {size} bytes but its header describes {8 + length + end}: "
                         f"{'truncated' if size < 8 + length + end else 'trailing bytes'}")
    return shapes


def checkpoint_tensor_problems(directory: str | Path, config: dict) -> list[str]:
    """Every strict-loading problem of a checkpoint read from its safetensors headers alone (what the
    server would refuse at load time, found before an overlay is made): unreadable or truncated
    files, missing, unexpected, duplicated or wrong-shape tensors, the classification head."""
    from sglang_openjev.checkpoint import interval_layout

    text = config.get("text_config") or config
    layer_types = list(text.get("layer_types") or [])
    if not layer_types and isinstance(text.get("full_attention_interval"), int):
        layer_types = interval_layout(text["full_attention_interval"], text.get("num_hidden_layers") or 0)
    seen: dict[str, tuple] = {}
    head: dict[str, tuple] = {}
    unexpected, duplicated, other = [], [], []
    for f in checkpoint_weight_files(directory):
        try:
            shapes = safetensors_header(f)
        except (OSError, ValueError) as exc:
            other.append(str(exc))
            continue
        for name, shape in shapes.items():
            kind, rel = route_weight(name)
            target = {BACKBONE: seen, HEAD: head}.get(kind)
            if target is None:
                if kind == UNEXPECTED:
                    unexpected.append(name)
                continue
            if rel in target:
                duplicated.append(name)
            target[rel] = shape
    if other:
        return other
    try:
        expected = expected_backbone_shapes(text, layer_types)
    except (TypeError, ValueError) as exc:  # a config without the sizes; the config checks say more
        return [f"cannot tell the expected tensor shapes from config.json text_config ({exc})"]
    missing, extra, mismatched = compare_shapes(seen, expected)
    try:
        check_head_weights(head, config.get("num_labels") or len(config.get("id2label") or {}), text.get("hidden_size"))
    except ValueError as exc:
        other.append(str(exc))
    return loading_problems(missing, unexpected + extra, duplicated, mismatched, other)


def safetensors_names(path: str | Path) -> list[str]:
    """Tensor names in a .safetensors file, read from its header only (no tensor data)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return [name for name in header if name != "__metadata__"]


def checkpoint_weight_files(directory: str | Path) -> list[Path]:
    """The .safetensors files a loader reads: those named by model.safetensors.index.json when
    there is one (SGLang's and Transformers' rule), else every *.safetensors (SGLang's rule)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return sorted({directory / f for f in weight_map.values()})
    return sorted(directory.glob("*.safetensors"))


def duplicated_names(files: Iterable[str | Path]) -> list[str]:
    """Names stored in more than one of `files` (a loader would read both copies, the last winning)."""
    seen: set[str] = set()
    dup: set[str] = set()
    for f in files:
        for name in safetensors_names(f):
            (dup if name in seen else seen).add(name)
    return sorted(dup)
