"""Validation of a checkpoint's content: every field's type and range, and the KV state against the model.

The store's manifest already refuses a file whose bytes changed; these checks
refuse content that is consistent on disk but cannot be a checkpoint this
code wrote for this model (a re-digested edit, a bug elsewhere), so a resume
either continues exactly or stops with a message naming the field.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from ..errors import MlxInferError
from ..sampling import SamplingParams
from .checkpoint_store import CheckpointError

FORMAT_VERSION = 2
META_KEYS = frozenset({"format_version", "identity", "fields", "model", "seed", "rng_steps", "generated_ids",
                       "emitted_text", "finished", "cache_layout"})
FIELD_KEYS = frozenset({"prompt_ids", "stop", "namespace", "execution", "binding", "sampling", "seed_mode"})
#: Seeds ``mx.random.key`` accepts.
MAX_SEED = (1 << 64) - 1
#: Token ids and counts above this are refused before any work is sized by them.
MAX_TOKEN_ID = (1 << 31) - 1
_HEX64 = re.compile(r"[0-9a-f]{64}")
_INT_TEXT = re.compile(r"\d{1,12}")
_CACHE_CLASSES = ("KVCache", "RotatingKVCache")


def _is_int(v: Any) -> bool:
    return type(v) is int


def _fail(where: str, field: str, rule: str, value: Any) -> CheckpointError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return CheckpointError(f"{where} is damaged: {field} must be {rule}, got {shown}. The checkpoint cannot "
                           "be resumed; start a new run (or restore the directory from a copy).")


def sampling_from_fields(fields: dict[str, Any], where: str) -> SamplingParams:
    """The :class:`SamplingParams` a checkpoint's identity fields describe (seed included when explicit)."""
    raw = fields["sampling"]
    try:
        values = dict(raw)
        values["logit_bias"] = {int(t): b for t, b in raw.get("logit_bias", [])}
        params = SamplingParams(**values)
    except (MlxInferError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where} is damaged: its sampling fields are invalid ({e}).") from None
    back = params.to_dict()
    if fields["seed_mode"] == "default":
        back.pop("seed", None)
    if back != raw:
        raise CheckpointError(f"{where} is damaged: its sampling fields are not in the form mlx-infer writes.")
    return params


def validate_meta(meta: Any, where: str) -> dict[str, Any]:
    """Check every field of a parsed ``checkpoint.json``; return it unchanged.

    Raises:
        CheckpointError: naming the first field that is missing, unknown, of the wrong type or out of range.
    """
    from .checkpoint import identity

    if not isinstance(meta, dict):
        raise _fail(where, "the document", "a JSON object", type(meta).__name__)
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{where} has checkpoint format version {version!r}; this mlx-infer reads "
                              f"version {FORMAT_VERSION}. Resume it with the mlx-infer that wrote it.")
    if set(meta) != META_KEYS:
        missing, extra = sorted(META_KEYS - set(meta)), sorted(set(meta) - META_KEYS)
        raise CheckpointError(f"{where} is damaged: " + "; ".join(
            ([f"it lacks {', '.join(missing)}"] if missing else []) +
            ([f"it has unknown fields {', '.join(extra)}"] if extra else [])) + ".")
    fields = meta["fields"]
    if not isinstance(fields, dict) or set(fields) != FIELD_KEYS:
        raise _fail(where, "fields", f"an object with exactly {sorted(FIELD_KEYS)}", fields)
    if not isinstance(meta["identity"], str) or not _HEX64.fullmatch(meta["identity"]):
        raise _fail(where, "identity", "a sha256 hex digest", meta["identity"])
    if identity(fields) != meta["identity"]:
        raise CheckpointError(f"{where} is damaged: its identity does not match its fields.")
    _validate_fields(fields, where)
    execution = fields["execution"]
    max_tokens = execution["max_tokens"]

    seed, steps, ids = meta["seed"], meta["rng_steps"], meta["generated_ids"]
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise _fail(where, "seed", f"an integer in [0, {MAX_SEED}]", seed)
    if fields["seed_mode"] == "explicit" and fields["sampling"].get("seed") != seed:
        raise _fail(where, "seed", f"the run's explicit seed {fields['sampling'].get('seed')!r}", seed)
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise _fail(where, "generated_ids", "a list of token ids (non-negative integers)", ids)
    if len(ids) > max_tokens:
        raise CheckpointError(f"{where} is damaged: it holds {len(ids)} generated tokens, more than the run's "
                              f"max_tokens {max_tokens}.")
    greedy = fields["sampling"]["temperature"] == 0
    want_steps = 0 if greedy else len(ids)
    if not _is_int(steps) or steps != want_steps:
        raise _fail(where, "rng_steps", f"{want_steps} (one key per sampled token of this run)", steps)
    if not isinstance(meta["emitted_text"], str):
        raise _fail(where, "emitted_text", "a string", meta["emitted_text"])
    if not isinstance(meta["finished"], bool):
        raise _fail(where, "finished", "true or false", meta["finished"])
    if not meta["finished"] and len(ids) >= max_tokens:
        raise CheckpointError(f"{where} is damaged: it holds all {max_tokens} tokens but is not marked finished.")
    if meta["model"] is not None and not isinstance(meta["model"], str):
        raise _fail(where, "model", "a path string or null", meta["model"])
    layout = meta["cache_layout"]
    if not isinstance(layout, list) or not layout:
        raise _fail(where, "cache_layout", "a non-empty list (one entry per cache)", layout)
    for i, layer in enumerate(layout):
        if (not isinstance(layer, dict) or set(layer) != {"class", "arrays", "meta_state"}
                or layer["class"] not in _CACHE_CLASSES or layer["arrays"] not in (0, 2)
                or type(layer["arrays"]) is not int or not isinstance(layer["meta_state"], list)
                or not all(isinstance(m, str) and _INT_TEXT.fullmatch(m) for m in layer["meta_state"])
                or len(layer["meta_state"]) != (0 if layer["class"] == "KVCache" else 3)):
            raise _fail(where, f"cache_layout[{i}]",
                        "{class: KVCache|RotatingKVCache, arrays: 0|2, meta_state: [integers as strings]}", layer)
    sampling_from_fields(fields, where)
    return meta


def _validate_fields(fields: dict[str, Any], where: str) -> None:
    prompt = fields["prompt_ids"]
    if (not isinstance(prompt, list) or not prompt
            or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in prompt)):
        raise _fail(where, "fields.prompt_ids", "a non-empty list of token ids", prompt)
    stop = fields["stop"]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _fail(where, "fields.stop", "a list of non-empty strings", stop)
    if not isinstance(fields["namespace"], str):
        raise _fail(where, "fields.namespace", "a string", fields["namespace"])
    if fields["seed_mode"] not in ("explicit", "default"):
        raise _fail(where, "fields.seed_mode", '"explicit" or "default"', fields["seed_mode"])
    execution = fields["execution"]
    if not isinstance(execution, dict):
        raise _fail(where, "fields.execution", "an object", execution)
    max_tokens = execution.get("max_tokens")
    if not _is_int(max_tokens) or not 0 <= max_tokens <= MAX_TOKEN_ID:
        raise _fail(where, "fields.execution.max_tokens", f"an integer in [0, {MAX_TOKEN_ID}]", max_tokens)
    for key, value in execution.items():
        if key != "max_tokens" and not isinstance(value, (bool, str)) and value is not None:
            raise _fail(where, f"fields.execution.{key}", "true/false or a string", value)
    binding = fields["binding"]
    if (not isinstance(binding, dict) or set(binding) != {"config_sha256", "weights", "dtype"}
            or not isinstance(binding["config_sha256"], str) or not isinstance(binding["weights"], list)
            or binding["dtype"] not in (None, "float32", "bfloat16", "float16")):
        raise _fail(where, "fields.binding", "{config_sha256, weights, dtype} as mlx-infer writes it", binding)
    sampling = fields["sampling"]
    if not isinstance(sampling, dict) or not isinstance(sampling.get("logit_bias", []), list):
        raise _fail(where, "fields.sampling", "an object of sampling parameters", sampling)
    if not isinstance(sampling.get("temperature"), (int, float)) or isinstance(sampling.get("temperature"), bool):
        raise _fail(where, "fields.sampling.temperature", "a number", sampling.get("temperature"))


def probe_model(model: Any) -> tuple[list[Any], list[tuple[int, int, int, mx.Dtype]], int]:
    """What a checkpoint's cache must look like for ``model``: a fresh cache list, each layer's
    ``(kv_heads, k_dim, v_dim, dtype)`` (from a one-token forward pass) and the vocabulary size."""
    fresh = model.make_cache()
    probe = model.make_cache()
    logits = model(mx.array([[0]], dtype=mx.uint32), cache=probe)  # (1, 1, vocab)
    shapes = []
    for c in probe:
        k, v = c.state
        shapes.append((k.shape[1], k.shape[3], v.shape[3], k.dtype))
    return fresh, shapes, logits.shape[-1]


def validate_against_model(meta: dict[str, Any], arrays: dict[str, mx.array], model: Any, where: str) -> list[Any]:
    """Check the KV arrays against ``model`` and the token counts; return the restored caches.

    Every layer's class and window must be the model's, its keys/values
    ``(1, kv_heads, S, D)`` of the model's dtype and finite, and the cached
    length what the run had fed: ``len(prompt) + len(generated) - 1`` once a
    token was generated, at most ``len(prompt) - 1`` before.
    """
    from ..state.kv import KVCache, RotatingKVCache

    fresh, shapes, vocab = probe_model(model)
    fields, layout = meta["fields"], meta["cache_layout"]
    for name, ids in (("fields.prompt_ids", fields["prompt_ids"]), ("generated_ids", meta["generated_ids"])):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise CheckpointError(f"{where} is damaged: {name} holds token ids outside this model's vocabulary "
                                  f"of {vocab} (e.g. {bad[0]}).")
    if len(layout) != len(fresh):
        raise CheckpointError(f"{where} holds {len(layout)} caches but this model has {len(fresh)}; it was not "
                              "saved for this model.")
    expected_keys = {f"layer{i}.{j}" for i, layer in enumerate(layout) for j in range(layer["arrays"])}
    if set(arrays) != expected_keys:
        odd = sorted(set(arrays) ^ expected_keys)[:4]
        raise CheckpointError(f"{where}: kv.safetensors does not hold the arrays its layout lists ({', '.join(odd)}).")
    n_prompt, n_gen = len(fields["prompt_ids"]), len(meta["generated_ids"])
    counts = set()
    cache = []
    for i, (layer, want, (kvh, kd, vd, dtype)) in enumerate(zip(layout, fresh, shapes)):
        cls_name = type(want).__name__
        if layer["class"] != cls_name:
            raise CheckpointError(f"{where}: cache {i} is a {layer['class']} but this model uses a {cls_name}.")
        meta_state = tuple(layer["meta_state"])
        if cls_name == "RotatingKVCache":
            max_size, offset, idx = map(int, meta_state)
            if max_size != want.max_size:
                raise CheckpointError(f"{where}: cache {i} has a window of {max_size} tokens but this model's "
                                      f"is {want.max_size}.")
        state = tuple(arrays[f"layer{i}.{j}"] for j in range(layer["arrays"]))
        if not state:
            length = offset if cls_name == "RotatingKVCache" else 0
            if length:
                raise CheckpointError(f"{where}: cache {i} records {length} tokens but holds no arrays.")
        else:
            k, v = state
            if (k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or k.shape[0] != 1
                    or (k.shape[1], k.shape[3], v.shape[3]) != (kvh, kd, vd)):
                raise CheckpointError(f"{where}: cache {i} holds keys {tuple(k.shape)} / values {tuple(v.shape)}; "
                                      f"this model's are (1, {kvh}, S, {kd}) / (1, {kvh}, S, {vd}).")
            if k.dtype != dtype or v.dtype != dtype:
                raise CheckpointError(f"{where}: cache {i} holds {k.dtype}/{v.dtype} arrays; this model computes "
                                      f"in {dtype}.")
            if not bool(mx.all(mx.isfinite(k)).item() and mx.all(mx.isfinite(v)).item()):
                raise CheckpointError(f"{where}: cache {i} holds non-finite values; the checkpoint is damaged.")
            s = k.shape[2]
            if cls_name == "RotatingKVCache":
                length = offset
                if not (0 < s <= offset and (s == offset or s >= max_size) and 0 <= idx <= s):
                    raise CheckpointError(f"{where}: cache {i}'s ring state (window {max_size}, offset {offset}, "
                                          f"slot {idx}) does not fit its {s} stored tokens.")
            else:
                length = s
        counts.add(length)
        cls = KVCache if cls_name == "KVCache" else RotatingKVCache
        try:
            cache.append(cls.from_state(state, meta_state))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: cache {i} cannot be restored ({e}).") from None
    if len(counts) != 1:
        raise CheckpointError(f"{where}: its caches hold different token counts ({sorted(counts)}).")
    (n_cached,) = counts
    want_n = n_prompt + n_gen - 1 if n_gen else None
    if (want_n is not None and n_cached != want_n) or (want_n is None and n_cached > n_prompt - 1):
        shown = want_n if want_n is not None else f"at most {n_prompt - 1}"
        raise CheckpointError(f"{where}: its caches hold {n_cached} tokens but the run had fed {shown} "
                              f"({n_prompt} prompt + {n_gen} generated); the checkpoint is damaged.")
    return cache
