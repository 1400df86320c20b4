"""Exactly resumable generation: identity, save and load.

A checkpoint directory (see :mod:`.checkpoint_store` for the layout, the
atomic publish, the marker and the lock) holds versions of two files:
``checkpoint.json`` (format version, identity, the fields it was computed
from, tokens, RNG position, emitted text, cache layout, the model's path) and
``kv.safetensors`` (the KV state). A manifest digest covers every byte of
both, and loading validates every field (:mod:`.checkpoint_validate`) and the
KV state against the model, so a damaged or edited checkpoint is refused with
a message, never resumed.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import MlxInferError
from ..sampling import RequestRNG, SamplingParams
from .checkpoint_store import CheckpointError, CheckpointStore, _op
from .checkpoint_validate import FORMAT_VERSION, sampling_from_fields, validate_against_model, validate_meta

__all__ = ["CheckpointError", "Checkpoint", "FORMAT_VERSION", "canonical_json", "identity_fields", "identity",
           "binding_identity", "save_checkpoint", "load_checkpoint", "read_checkpoint", "generate_checkpointed"]

_META = "checkpoint.json"
_KV = "kv.safetensors"


def canonical_json(value: Any) -> str:
    """JSON with sorted object keys and no whitespace: the identity's byte form."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _as_json(value: Any) -> Any:
    """``value`` as JSON would give it back (tuples become lists), so comparisons match what was saved."""
    return json.loads(canonical_json(value))


def identity_fields(*, prompt_ids: list[int], sampling: SamplingParams, binding: dict[str, Any],
                    stop: list[str] | tuple[str, ...] = (), namespace: str = "",
                    execution: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything that can change a continuation, as a JSON-ready dict (lists, never tuples)."""
    sampling_fields = sampling.to_dict()
    seed_mode = "explicit" if sampling.seed is not None else "default"
    if seed_mode == "default":
        sampling_fields.pop("seed", None)
    return _as_json({
        "prompt_ids": list(prompt_ids),
        "stop": list(stop),
        "namespace": namespace,
        "execution": execution or {},
        "binding": binding,
        "sampling": sampling_fields,
        "seed_mode": seed_mode,
    })


def identity(fields: dict[str, Any]) -> str:
    """sha256 hex digest of the canonical JSON of ``fields``."""
    return hashlib.sha256(canonical_json(fields).encode("utf-8")).hexdigest()


def binding_identity(model_dir: Path, *, dtype: str | None) -> dict[str, Any]:
    """What identifies the weights a run used: config.json's hash and the weight files' names and sizes."""
    config = (model_dir / "config.json").read_bytes()
    files = sorted([f.name, f.stat().st_size] for f in model_dir.glob("*.safetensors"))
    return {"config_sha256": hashlib.sha256(config).hexdigest(), "weights": files, "dtype": dtype}


@dataclass
class Checkpoint:
    """A loaded checkpoint: enough to continue exactly where the run stopped.

    ``cache`` is ``None`` when it was read without a model (:func:`read_checkpoint`).
    """

    identity: str
    fields: dict[str, Any]
    seed: int
    rng_steps: int
    generated_ids: list[int]
    emitted_text: str
    finished: bool
    cache: list[Any] | None
    model: str | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.fields["prompt_ids"])

    @property
    def max_tokens(self) -> int:
        return int(self.fields["execution"]["max_tokens"])

    @property
    def stop(self) -> list[str]:
        return list(self.fields["stop"])

    @property
    def execution(self) -> dict[str, Any]:
        """The execution choices, without ``max_tokens``."""
        return {k: v for k, v in self.fields["execution"].items() if k != "max_tokens"}

    @property
    def dtype(self) -> str | None:
        return self.fields["binding"]["dtype"]

    def sampling(self) -> SamplingParams:
        """The run's sampling parameters."""
        return sampling_from_fields(self.fields, "the checkpoint")

    def rng(self) -> RequestRNG:
        """The request's key sequence at the saved position."""
        return RequestRNG.from_state((self.seed, self.rng_steps, self.fields["seed_mode"] == "explicit"),
                                     max_steps=len(self.generated_ids))


def _write_version(vdir: Path, meta: dict[str, Any], arrays: dict[str, mx.array]) -> None:
    _op("write kv")
    mx.save_safetensors(str(vdir / _KV), arrays)
    _op("write meta")
    with open(vdir / _META, "x", encoding="utf-8") as fh:
        fh.write(canonical_json(meta))


def save_checkpoint(directory: str | Path, *, fields: dict[str, Any], rng: RequestRNG, generated_ids: list[int],
                    emitted_text: str, cache: list[Any], finished: bool = False, model: str | None = None,
                    store: CheckpointStore | None = None) -> Path:
    """Atomically write a checkpoint to ``directory`` (replacing an earlier one of the same run).

    Refuses a directory mlx-infer did not make, one holding another run's
    checkpoint, and one another process has open. ``store`` is an already
    open (locked) :class:`CheckpointStore` of ``directory``.
    """
    fields = _as_json(fields)
    ident = identity(fields)
    own = store is None
    store = store or CheckpointStore.open(directory, write=True)
    try:
        _check_replaceable(store, ident)
        arrays: dict[str, mx.array] = {}
        layout = []
        for i, c in enumerate(cache):
            state = tuple(c.state)
            for j, a in enumerate(state):
                arrays[f"layer{i}.{j}"] = a
            layout.append({"class": type(c).__name__, "arrays": len(state), "meta_state": list(c.meta_state)})
        rng_state = rng.state()
        meta = {
            "format_version": FORMAT_VERSION,
            "identity": ident,
            "fields": fields,
            "model": model,
            "seed": rng_state.seed,
            "rng_steps": rng_state.steps,
            "generated_ids": list(generated_ids),
            "emitted_text": emitted_text,
            "finished": finished,
            "cache_layout": layout,
        }
        try:
            store.publish(lambda vdir: _write_version(vdir, meta, arrays))
        except OSError as e:
            raise CheckpointError(f"could not save the checkpoint in {store.path}: {e.strerror or e}.") from None
    finally:
        if own:
            store.close()
    return store.path


def _check_replaceable(store: CheckpointStore, ident: str) -> None:
    """A writer may replace only a checkpoint of its own run (or an empty store)."""
    try:
        current = store.current(verify_kv=False)  # its identity is all we need; loads verify every byte
    except CheckpointError as e:
        raise CheckpointError(f"{store.path} holds a damaged checkpoint ({e}); refusing to overwrite it. "
                              "Delete it or choose another directory.") from None
    if current is None:
        return
    try:
        existing = json.loads(current[0].decode("utf-8")).get("identity")
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError):
        existing = None
    if existing != ident:
        raise CheckpointError(f"{store.path} holds a checkpoint of a different run; refusing to overwrite it. "
                              "Resume it with --resume, or choose another directory.")


def _describe_difference(saved: dict[str, Any], now: dict[str, Any]) -> str:
    parts = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if a == b:
            continue
        if key == "binding":
            parts.append("the model (its weights, config or dtype)")
        elif (key == "execution" and isinstance(a, dict) and isinstance(b, dict)
              and a.get("adapter") != b.get("adapter")):
            was, now_ = a.get("adapter"), b.get("adapter")
            parts.append(f"the adapter ({'none' if was is None else repr(was)} saved, "
                         f"{'none' if now_ is None else repr(now_)} now: give --adapter-path the run's adapter"
                         f"{'' if was is not None else ' only if it had one'})")
            rest = {k for k in set(a) | set(b) if k != "adapter" and a.get(k) != b.get(k)}
            parts.extend(f"execution.{k} ({a.get(k)!r} saved, {b.get(k)!r} now)" for k in sorted(rest))
        elif isinstance(a, dict) and isinstance(b, dict):
            sub = [f"{key}.{k} ({a.get(k)!r} saved, {b.get(k)!r} now)" for k in sorted(set(a) | set(b))
                   if a.get(k) != b.get(k)]
            parts.extend(sub)
        elif key == "prompt_ids":
            parts.append("the prompt")
        else:
            parts.append(f"{key} ({a!r} saved, {b!r} now)")
    return "; ".join(parts)


def _read(store: CheckpointStore, *, expected_fields: dict[str, Any] | None, model: Any) -> Checkpoint:
    where = str(store.path)
    current = store.current()
    if current is None:
        raise CheckpointError(f"{where} holds no saved checkpoint yet (the run that made it saved none).")
    raw, kv_path = current
    try:
        meta = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise CheckpointError(f"{kv_path.parent / _META} is damaged ({e}); the checkpoint cannot be resumed.") \
            from None
    meta = validate_meta(meta, where)
    if expected_fields is not None:
        expected = _as_json(expected_fields)
        if identity(expected) != meta["identity"]:
            raise CheckpointError(
                f"{where} was saved by a different run (it differs in: "
                f"{_describe_difference(meta['fields'], expected)}); refusing to resume it with these "
                "arguments. Resume with --resume DIR alone, or start a new run.")
    cache = None
    if model is not None:
        try:
            arrays = mx.load(str(kv_path))
        except (RuntimeError, ValueError, OSError) as e:
            raise CheckpointError(f"{kv_path} cannot be read ({e}); the checkpoint is damaged.") from None
        if not isinstance(arrays, dict):
            raise CheckpointError(f"{kv_path} is not a safetensors file of named arrays; it is damaged.")
        cache = validate_against_model(meta, arrays, model, where)
    return Checkpoint(identity=meta["identity"], fields=meta["fields"], seed=meta["seed"],
                      rng_steps=meta["rng_steps"], generated_ids=list(meta["generated_ids"]),
                      emitted_text=meta["emitted_text"], finished=meta["finished"], cache=cache,
                      model=meta["model"])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_checkpoint(directory: str | Path, *, expected_fields: dict[str, Any] | None = None, model: Any = None,
                    store: CheckpointStore | None = None) -> Checkpoint:
    """Read and validate a checkpoint; with ``expected_fields`` (this run's identity fields), refuse one
    of another run; with ``model``, restore its KV caches after checking them against the model.

    Raises:
        CheckpointError: not a checkpoint directory, a damaged, edited or
            truncated file, another format version, locked by a writer, or an
            identity mismatch (the message says which).
    """
    own = store is None
    store = store or CheckpointStore.open(directory, write=False)
    try:
        return _read(store, expected_fields=expected_fields, model=model)
    finally:
        if own:
            store.close()


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """The checkpoint's fields, checked, without its KV state (``cache`` is ``None``): what a
    resume needs to know before it loads the model."""
    return load_checkpoint(directory)


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

    ``directory`` stays locked until the generation ends (or is closed), so a
    second process on it is refused instead of interleaving saves.

    Returns:
        A :class:`~mlx_infer.generation.autoregressive.Generation` of text items.

    Raises:
        CheckpointError: ``directory`` is not ours, is in use, holds another
            run's checkpoint, or (resuming) holds none or a damaged one.
    """
    from .autoregressive import Generation, GenerateStats, generate_tokens, newline_ids, stream_text

    if type(every) is not int or every < 1:
        raise MlxInferError(f"the checkpoint interval must be an integer >= 1 token, got {every!r}.")
    # The adapter in use (generate --adapter-path: name and content hash) is part of the run's
    # identity: a resume under another adapter, or none, is refused. A resumed run's saved
    # execution carries the saved one; what counts is the one loaded now.
    from ..adapters.select import default_adapter_identity

    execution = {k: v for k, v in dict(execution or {}).items() if k != "adapter"}
    adapter = default_adapter_identity(loaded.model)
    if adapter is not None:
        execution["adapter"] = adapter
    execution["max_tokens"] = max_tokens
    fields = identity_fields(prompt_ids=prompt_ids, sampling=sampling, stop=list(stop), execution=execution,
                             binding=binding_identity(Path(loaded.path), dtype=dtype))
    source = getattr(loaded, "source", None)
    model_path = None if source in (None, "default") else os.path.abspath(os.path.expanduser(source))
    store = CheckpointStore.open(directory, write=True, create=not resume)  # locked until the generation ends
    try:
        generated: list[int] = []
        emitted = ""
        cache = rng = None
        if resume:
            ck = load_checkpoint(directory, expected_fields=fields, model=loaded.model, store=store)
            if ck.finished:
                store.close()
                return Generation(iter(()), GenerateStats(prompt_tokens=len(prompt_ids), finish_reason="stop"))
            generated, emitted, cache, rng = list(ck.generated_ids), ck.emitted_text, ck.cache, ck.rng()
        else:
            rng = RequestRNG(sampling.seed)
            _check_replaceable(store, identity(fields))
        prior = list(generated)
        tokens = generate_tokens(
            loaded.model, list(prompt_ids) + prior, sampling=sampling, max_tokens=max_tokens - len(prior),
            eos_token_ids=loaded.eos_token_ids, newline_token_ids=newline_ids(loaded),
            context_length=loaded.context_length, cancel=cancel, cache=cache, rng=rng,
            start_index=len(prior), pipeline=False,
        )
        text = stream_text(loaded, tokens, stop=stop, prime_ids=prior)
    except BaseException:
        store.close()
        raise
    state = tokens.state

    def save(finished: bool) -> None:
        save_checkpoint(directory, fields=fields, rng=state.rng, generated_ids=generated, emitted_text=emitted,
                        cache=state.cache, finished=finished, model=model_path, store=store)

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
            try:
                text.close()
                if not finished:
                    save(False)
            finally:
                store.close()

    return Generation(items(), text.stats, state)
