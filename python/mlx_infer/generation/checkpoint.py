"""Exactly resumable generation: identity, save and load.

A checkpoint directory holds ``checkpoint.json`` (format version, identity,
the fields it was computed from, tokens, RNG position, emitted text, cache
layout) and ``kv.safetensors`` (the KV state). It is written to a temporary
directory beside the target and renamed into place, so a crash mid-write
never leaves a half checkpoint and never clobbers the previous one.

The identity is sha256 over canonical JSON (object keys sorted, arrays kept
in order) of everything that can change the continuation: prompt ids, stop
strings, cache namespace, execution choices, the binding's identity and every
sampling field. A seed the run picked itself is not part of it (it travels in
the checkpoint); an explicit seed is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import MlxInferError
from ..sampling import RequestRNG, SamplingParams

FORMAT_VERSION = 1
_META = "checkpoint.json"
_KV = "kv.safetensors"


class CheckpointError(MlxInferError):
    """A checkpoint is missing, damaged, of another format, or belongs to another run."""


def canonical_json(value: Any) -> str:
    """JSON with sorted object keys and no whitespace: the identity's byte form."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def identity_fields(*, prompt_ids: list[int], sampling: SamplingParams, binding: dict[str, Any],
                    stop: list[str] | tuple[str, ...] = (), namespace: str = "",
                    execution: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything that can change a continuation, as a JSON-ready dict."""
    sampling_fields = sampling.to_dict()
    seed_mode = "explicit" if sampling.seed is not None else "default"
    if seed_mode == "default":
        sampling_fields.pop("seed", None)
    return {
        "prompt_ids": list(prompt_ids),
        "stop": list(stop),
        "namespace": namespace,
        "execution": execution or {},
        "binding": binding,
        "sampling": sampling_fields,
        "seed_mode": seed_mode,
    }


def identity(fields: dict[str, Any]) -> str:
    """sha256 hex digest of the canonical JSON of ``fields``."""
    return hashlib.sha256(canonical_json(fields).encode("utf-8")).hexdigest()


def binding_identity(model_dir: Path, *, dtype: str | None) -> dict[str, Any]:
    """What identifies the weights a run used: config.json's hash and the weight files' names and sizes."""
    config = (model_dir / "config.json").read_bytes()
    files = sorted((f.name, f.stat().st_size) for f in model_dir.glob("*.safetensors"))
    return {"config_sha256": hashlib.sha256(config).hexdigest(), "weights": files, "dtype": dtype}


@dataclass
class Checkpoint:
    """A loaded checkpoint: enough to continue exactly where the run stopped."""

    identity: str
    fields: dict[str, Any]
    seed: int
    rng_steps: int
    generated_ids: list[int]
    emitted_text: str
    finished: bool
    cache: list[Any]

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.fields["prompt_ids"])

    def rng(self) -> RequestRNG:
        """The request's key sequence at the saved position."""
        return RequestRNG.from_state((self.seed, self.rng_steps, self.fields["seed_mode"] == "explicit"))


def save_checkpoint(directory: str | Path, *, fields: dict[str, Any], rng: RequestRNG, generated_ids: list[int],
                    emitted_text: str, cache: list[Any], finished: bool = False) -> Path:
    """Atomically write a checkpoint to ``directory`` (replacing an earlier one of the same run).

    Refuses to overwrite a directory that holds anything but a checkpoint of this run.
    """
    directory = Path(directory)
    ident = identity(fields)
    if directory.exists():
        _check_replaceable(directory, ident)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        arrays: dict[str, mx.array] = {}
        layout = []
        for i, c in enumerate(cache):
            state = tuple(c.state)
            for j, a in enumerate(state):
                arrays[f"layer{i}.{j}"] = a
            layout.append({"class": type(c).__name__, "arrays": len(state), "meta_state": list(c.meta_state)})
        mx.save_safetensors(str(tmp / _KV), arrays)
        rng_state = rng.state()
        meta = {
            "format_version": FORMAT_VERSION,
            "identity": ident,
            "fields": fields,
            "seed": rng_state.seed,
            "rng_steps": rng_state.steps,
            "generated_ids": list(generated_ids),
            "emitted_text": emitted_text,
            "finished": finished,
            "cache_layout": layout,
        }
        (tmp / _META).write_text(canonical_json(meta), encoding="utf-8")
        for f in tmp.iterdir():  # make the bytes durable before the rename publishes them
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
            tmp.rename(directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _check_replaceable(directory: Path, ident: str) -> None:
    if not directory.is_dir():
        raise CheckpointError(f"{directory} exists and is not a checkpoint directory; choose another path.")
    entries = {p.name for p in directory.iterdir()}
    if not entries:
        return
    if not entries <= {_META, _KV}:
        raise CheckpointError(f"{directory} holds other files ({', '.join(sorted(entries - {_META, _KV}))}); "
                              "refusing to overwrite it. Choose an empty or new directory.")
    try:
        existing = json.loads((directory / _META).read_text(encoding="utf-8")).get("identity")
    except (OSError, json.JSONDecodeError):
        existing = None
    if existing != ident:
        raise CheckpointError(f"{directory} holds a checkpoint of a different run; refusing to overwrite it. "
                              "Resume it with --resume, or choose another directory.")


def load_checkpoint(directory: str | Path, *, expected_fields: dict[str, Any] | None = None) -> Checkpoint:
    """Read a checkpoint; with ``expected_fields`` (this run's identity fields), refuse one of another run.

    Raises:
        CheckpointError: missing files, a damaged or truncated file, another
            format version, or an identity mismatch (the message says which).
    """
    from ..state.kv import KVCache, RotatingKVCache

    directory = Path(directory)
    meta_path, kv_path = directory / _META, directory / _KV
    if not meta_path.is_file() or not kv_path.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint (it needs {_META} and {_KV}).")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is damaged ({e}); the checkpoint cannot be resumed.") from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{directory} has checkpoint format version {version!r}; this mlx-infer reads "
                              f"version {FORMAT_VERSION}. Resume it with the mlx-infer that wrote it.")
    try:
        if identity(meta["fields"]) != meta["identity"]:
            raise CheckpointError(f"{meta_path} is damaged: its identity does not match its fields.")
        arrays = mx.load(str(kv_path))
    except KeyError as e:
        raise CheckpointError(f"{meta_path} lacks {e}; the checkpoint is damaged.") from None
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{kv_path} is truncated or damaged ({e}); the checkpoint cannot be resumed.") from None
    if expected_fields is not None and identity(expected_fields) != meta["identity"]:
        differ = sorted(k for k in set(meta["fields"]) | set(expected_fields)
                        if meta["fields"].get(k) != expected_fields.get(k))
        raise CheckpointError(
            f"{directory} was saved by a different run (it differs in: {', '.join(differ)}); refusing to "
            "resume it with these arguments. Repeat the original command with --resume, or start a new run.")
    classes = {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache}
    cache = []
    for i, layer in enumerate(meta["cache_layout"]):
        cls = classes.get(layer["class"])
        if cls is None:
            raise CheckpointError(f"{directory} holds a {layer['class']} cache, which cannot be restored.")
        try:
            state = tuple(arrays[f"layer{i}.{j}"] for j in range(layer["arrays"]))
        except KeyError:
            raise CheckpointError(f"{kv_path} lacks layer {i}'s arrays; the checkpoint is damaged.") from None
        cache.append(cls.from_state(state, tuple(layer["meta_state"])))
    return Checkpoint(identity=meta["identity"], fields=meta["fields"], seed=meta["seed"],
                      rng_steps=meta["rng_steps"], generated_ids=meta["generated_ids"],
                      emitted_text=meta["emitted_text"], finished=meta["finished"], cache=cache)


def generate_checkpointed(
    loaded: Any,
    prompt_ids: list[int],
    directory: str | Path,
    *,
    sampling: SamplingParams,
    max_tokens: int,
    stop: list[str] | tuple[str, ...] = (),
    resume: bool = False,
    every: int = 16,
    dtype: str | None = None,
    cancel: Any = None,
    execution: dict[str, Any] | None = None,
) -> Any:
    """Generate text after ``prompt_ids``, saving a checkpoint to ``directory`` as it goes.

    A checkpoint is written every ``every`` tokens, when the generation ends
    and when it is cancelled or closed early (e.g. on Ctrl-C through a cancel
    token). With ``resume=True`` the run continues from the checkpoint in
    ``directory`` (which must come from the same prompt, sampling, stops,
    model and execution choices) and yields only the tokens after it: the
    text of the first run followed by the text of the resumed one equals the
    text of an uninterrupted run.

    Returns:
        A :class:`~mlx_infer.generation.autoregressive.Generation` of text items.
    """
    from .autoregressive import Generation, GenerateStats, generate_tokens, newline_ids, stream_text

    if every < 1:
        raise MlxInferError(f"the checkpoint interval must be >= 1 token, got {every}.")
    execution = dict(execution or {}, max_tokens=max_tokens)
    fields = identity_fields(prompt_ids=prompt_ids, sampling=sampling, stop=list(stop), execution=execution,
                             binding=binding_identity(Path(loaded.path), dtype=dtype))
    generated: list[int] = []
    emitted = ""
    cache = rng = None
    if resume:
        ck = load_checkpoint(directory, expected_fields=fields)
        if ck.finished:
            return Generation(iter(()), GenerateStats(prompt_tokens=len(prompt_ids), finish_reason="stop"))
        generated, emitted, cache, rng = list(ck.generated_ids), ck.emitted_text, ck.cache, ck.rng()
    else:
        rng = RequestRNG(sampling.seed)
        if Path(directory).exists():
            _check_replaceable(Path(directory), identity(fields))
    prior = list(generated)
    tokens = generate_tokens(
        loaded.model, list(prompt_ids) + prior, sampling=sampling, max_tokens=max_tokens - len(prior),
        eos_token_ids=loaded.eos_token_ids, newline_token_ids=newline_ids(loaded),
        context_length=loaded.context_length, cancel=cancel, cache=cache, rng=rng,
        start_index=len(prior), pipeline=False,
    )
    text = stream_text(loaded, tokens, stop=stop, prime_ids=prior)
    state = tokens.state

    def save(finished: bool) -> None:
        save_checkpoint(directory, fields=fields, rng=state.rng, generated_ids=generated, emitted_text=emitted,
                        cache=state.cache, finished=finished)

    def items() -> Any:
        nonlocal emitted
        finished = False
        try:
            for item in text:
                generated.append(item.token)
                emitted += item.text
                finished = item.finish_reason in ("stop", "length")
                if finished or (item.index + 1) % every == 0:
                    save(finished)
                yield item
        finally:
            text.close()
            if not finished:
                save(False)

    return Generation(items(), text.stats, state)
