"""The denoising generation loop: block diffusion over a :class:`DenoisingBinding`.

It plugs into the same result contract as the autoregressive loop: a
:class:`~.autoregressive.Generation` of :class:`~.text_output.TokenEvent`
with :class:`~.autoregressive.GenerateStats`. What happens, per request::

    state = prefill(prompt)
    for each block (until EOS or the token limit):
        canvas = initial canvas (injected) or C uniform random tokens     <- key n of the request
        feedback = None
        for step = N .. 1:                                                 <- cancellation checked here
            logits    = decoder_logits(canvas, state, feedback) / T(step)   T: t_min + (t_max - t_min) step/N
            argmax    = argmax(logits)
            proposal  = argmax (greedy) or a categorical draw             <- next key
            accept    = sampler(logits, proposal)                         entropy-bound | confidence-threshold
            canvas    = accept ? proposal : fresh random tokens           <- next key (re-noise)
            feedback  = soft_embeddings(logits)
            stop early when argmax is stable and the mean entropy is low
        block = argmax of the last step; its tokens are yielded (final)
        extend_prefill(block, state)

The samplers (every step proposes every position again; accepted positions
enter the next step with their proposal, the rest are re-noised, as in
transformers' ``EntropyBoundSampler``):

1. ``entropy-bound``: sort positions by entropy ascending and accept the
   longest prefix with ``sum(entropies) - max(entropy) <= entropy_bound``.
2. ``confidence-threshold``: accept every position whose proposal has
   probability ``>= confidence_threshold``, else the single most confident one.

Early stop (``StableAndConfidentStoppingCriteria``): the argmax canvas equals
each of the previous ``stability_steps`` argmax canvases and the mean entropy
of the scaled logits is below ``stop_entropy``.

Generation ends at any token of ``{1, 106}`` united with the caller's EOS ids
(the token is yielded, ``finish_reason="stop"``) or after ``max_tokens``
(256 unless the caller sets a limit). Stats count the encoder prefill as
prefill time and every block (denoising + extending the state) as decode time.
Closing the generation, or a cancellation seen between steps, releases the state.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import mlx.core as mx

from .. import defaults
from ..errors import MlxInferError, PromptTooLongError
from ..sampling import RequestRNG, SamplingParams
from .autoregressive import GenerateStats, Generation, prompt_ids_for, stream_text
from .bindings.denoising import DenoisingBinding, assert_denoising_graph, bind_denoising
from .stopping import CancelToken
from .text_output import TokenEvent, token_finish

if TYPE_CHECKING:
    from ..artifacts.loader import LoadedModel

DEFAULT_MAX_TOKENS = defaults.MAX_TOKENS
#: EOS ids every denoising request stops on (the checkpoint's ``<eos>`` and ``<end_of_turn>``).
DEFAULT_EOS_TOKEN_IDS = frozenset({1, 106})
DEFAULT_STEPS = 48
DEFAULT_T_MAX = 0.8
DEFAULT_T_MIN = 0.4
DEFAULT_ENTROPY_BOUND = 0.1
DEFAULT_CONFIDENCE_THRESHOLD = 0.9
DEFAULT_STABILITY_STEPS = 1
DEFAULT_STOP_ENTROPY = 0.005
SAMPLERS = ("entropy-bound", "confidence-threshold")


def _fail(name: str, rule: str, value: Any) -> MlxInferError:
    return MlxInferError(f"DenoisingParams.{name} must be {rule}, got {value!r}.")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, "a finite number", value)
    return float(value)


@dataclass(frozen=True, kw_only=True)
class DenoisingParams:
    """How one denoising request turns canvases into tokens.

    Args:
        sampler: ``"entropy-bound"`` or ``"confidence-threshold"`` (see the module docstring).
        steps: denoising steps per block (>= 1).
        t_max: temperature of the first step; ``t_max > t_min``.
        t_min: temperature the schedule ends at (>= 0; the last step uses ``t_min + (t_max - t_min) / steps``).
        greedy: propose each position's argmax instead of a categorical draw.
        entropy_bound: > 0, for the entropy-bound sampler.
        confidence_threshold: in (0, 1], for the confidence-threshold sampler.
        stability_steps: >= 0 previous argmax canvases the current one must equal to stop early.
        stop_entropy: > 0 mean-entropy bound to stop early; ``None`` runs every step.
        seed: >= 0 reproduces the request's canvases and draws; ``None`` picks a fresh one.
    """

    sampler: str = "entropy-bound"
    steps: int = DEFAULT_STEPS
    t_max: float = DEFAULT_T_MAX
    t_min: float = DEFAULT_T_MIN
    greedy: bool = False
    entropy_bound: float = DEFAULT_ENTROPY_BOUND
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD
    stability_steps: int = DEFAULT_STABILITY_STEPS
    stop_entropy: float | None = DEFAULT_STOP_ENTROPY
    seed: int | None = None

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.sampler not in SAMPLERS:
            raise _fail("sampler", f"one of {', '.join(map(repr, SAMPLERS))}", self.sampler)
        for name in ("steps", "stability_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "steps" else 0):
                raise _fail(name, "an integer >= 1" if name == "steps" else "an integer >= 0", v)
        for name in ("t_max", "t_min", "entropy_bound", "confidence_threshold"):
            put(name, _number(name, getattr(self, name)))
        if self.t_min < 0:
            raise _fail("t_min", ">= 0", self.t_min)
        if self.t_max <= self.t_min:
            raise MlxInferError(f"DenoisingParams.t_max must be greater than t_min (the schedule runs from t_max "
                                f"down to t_min), got t_max={self.t_max!r}, t_min={self.t_min!r}.")
        if self.entropy_bound <= 0:
            raise _fail("entropy_bound", "> 0", self.entropy_bound)
        if not 0 < self.confidence_threshold <= 1:
            raise _fail("confidence_threshold", "in (0, 1]", self.confidence_threshold)
        if self.stop_entropy is not None:
            put("stop_entropy", _number("stop_entropy", self.stop_entropy))
            if self.stop_entropy <= 0:
                raise _fail("stop_entropy", "> 0 (or None to run every step)", self.stop_entropy)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise _fail("seed", "a non-negative integer or None", self.seed)

    def temperature(self, step: int) -> float:
        """The temperature of step ``step`` (counting down from ``steps`` to 1)."""
        return self.t_min + (self.t_max - self.t_min) * step / self.steps


def request_params(sampling: SamplingParams | None = None,
                   generation_config: Mapping[str, Any] | None = None) -> DenoisingParams:
    """The denoising settings of a request given as :class:`SamplingParams`.

    ``temperature == 0``: greedy proposals, confidence-threshold sampler (the
    served default). ``temperature > 0``: categorical proposals, entropy-bound
    sampler, schedule from ``t_max = temperature`` down to ``t_min`` in the
    checkpoint's ratio (``t_min / t_max``, 0.4 / 0.8 by default). Steps,
    schedule, entropy bound and early stop default to the checkpoint's
    ``generation_config.json`` (``max_denoising_steps``, ``t_max``, ``t_min``,
    ``sampler_config.entropy_bound``, ``stability_threshold``,
    ``confidence_threshold``). The seed is the request's.

    Raises:
        MlxInferError: ``sampling`` uses a filter or penalty the denoising method does not have.
    """
    sampling, plain = sampling or SamplingParams(), SamplingParams()
    unused = [f.name for f in dataclasses.fields(SamplingParams)
              if f.name not in ("temperature", "seed") and getattr(sampling, f.name) != getattr(plain, f.name)]
    if unused:
        raise MlxInferError(f"the denoising method takes only a temperature and a seed; {', '.join(unused)} "
                            "cannot be applied to a diffusion model.")
    gc = {k: v for k, v in (generation_config or {}).items() if v is not None}  # HF writes unset keys as null
    t_max, t_min = gc.get("t_max", DEFAULT_T_MAX), gc.get("t_min", DEFAULT_T_MIN)
    sampler_config = gc.get("sampler_config") if isinstance(gc.get("sampler_config"), dict) else {}
    common = dict(steps=gc.get("max_denoising_steps", DEFAULT_STEPS),
                  entropy_bound=sampler_config.get("entropy_bound", DEFAULT_ENTROPY_BOUND),
                  stability_steps=gc.get("stability_threshold", DEFAULT_STABILITY_STEPS),
                  stop_entropy=gc.get("confidence_threshold", DEFAULT_STOP_ENTROPY), seed=sampling.seed)
    if sampling.temperature == 0:
        return DenoisingParams(sampler="confidence-threshold", greedy=True, t_max=t_max, t_min=t_min, **common)
    ratio = t_min / t_max if t_max else DEFAULT_T_MIN / DEFAULT_T_MAX
    return DenoisingParams(sampler="entropy-bound", t_max=sampling.temperature,
                           t_min=sampling.temperature * ratio, **common)


class CanvasNoise:
    """A request's random draws, each with the next key of its :class:`RequestRNG`.

    Args:
        vocab_size: canvas tokens are uniform in ``[0, vocab_size)``.
        canvas_length: tokens per canvas.
        rng: the request's key sequence.
    """

    def __init__(self, vocab_size: int, canvas_length: int, rng: RequestRNG):
        self.vocab_size, self.canvas_length, self.rng = vocab_size, canvas_length, rng

    def canvas(self) -> mx.array:
        """A uniform random canvas ``(1, C)`` int32."""
        return mx.random.randint(0, self.vocab_size, (1, self.canvas_length), dtype=mx.int32,
                                 key=self.rng.next_key())

    def propose(self, logits: mx.array) -> mx.array:
        """One categorical draw per position of ``logits (1, C, V)``: ``(1, C)``."""
        return mx.random.categorical(logits, axis=-1, key=self.rng.next_key()).astype(mx.int32)


def _entropy_bound_accept(entropy: mx.array, bound: float) -> mx.array:
    """Accept the lowest-entropy positions while ``sum - max <= bound`` over them: ``(1, C)`` bool."""
    order = mx.argsort(entropy, axis=-1)
    ranked = mx.take_along_axis(entropy, order, axis=-1)  # ascending, so the running max is the last one
    chosen = (mx.cumsum(ranked, axis=-1) - ranked) <= bound
    return mx.put_along_axis(mx.zeros(chosen.shape, mx.bool_), order, chosen, axis=-1)


def _confidence_accept(probs: mx.array, proposal: mx.array, threshold: float) -> mx.array:
    """Accept proposals with probability ``>= threshold``, else the single most confident: ``(1, C)`` bool."""
    conf = mx.take_along_axis(probs, proposal[..., None], axis=-1).squeeze(-1)  # (1, C)
    accept = conf >= threshold
    best = mx.arange(conf.shape[-1])[None] == mx.argmax(conf, axis=-1, keepdims=True)  # (1, C)
    return mx.where(accept.any(axis=-1, keepdims=True), accept, best)


def _denoise_block(binding: DenoisingBinding, state: Any, canvas: mx.array, params: DenoisingParams,
                   noise: CanvasNoise, cancel: CancelToken | None) -> mx.array | None:
    """Denoise one canvas ``(1, C)``; its final tokens ``(1, C)``, or ``None`` when cancelled."""
    feedback = None
    history: list[mx.array] = []
    final = canvas
    for step in range(params.steps, 0, -1):
        if cancel is not None and cancel.cancelled:
            return None
        logits = binding.decoder_logits(canvas, state, feedback) / params.temperature(step)  # (1, C, V)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        probs = mx.exp(logp)
        entropy = -(probs * logp).sum(axis=-1)  # (1, C)
        argmax = mx.argmax(logits, axis=-1).astype(mx.int32)  # (1, C)
        proposal = argmax if params.greedy else noise.propose(logits)
        if params.sampler == "entropy-bound":
            accept = _entropy_bound_accept(entropy, params.entropy_bound)
        else:
            accept = _confidence_accept(probs, proposal, params.confidence_threshold)
        canvas = mx.where(accept, proposal, noise.canvas())
        feedback = binding.soft_embeddings(logits)
        final = argmax
        if params.stop_entropy is None:
            mx.eval(canvas, feedback, final)
            continue
        stable = mx.array(len(history) == params.stability_steps)
        for previous in history:
            stable = stable & mx.array_equal(previous, argmax)
        stop = stable & (entropy.mean() < params.stop_entropy)
        history = (history + [argmax])[-params.stability_steps:] if params.stability_steps else []
        mx.eval(canvas, feedback, final, stop)
        if stop.item():
            break
    return final


def generate_denoising(
    binding: DenoisingBinding,
    prompt_ids: Iterable[int],
    *,
    params: DenoisingParams = DenoisingParams(),
    max_tokens: int | None = None,
    eos_token_ids: Iterable[int] = (),
    context_length: int | None = None,
    cancel: CancelToken | None = None,
    initial_canvas: Any = None,
    noise: CanvasNoise | None = None,
) -> Generation:
    """Generate token ids after ``prompt_ids`` by block diffusion.

    Args:
        binding: from :func:`~.bindings.denoising.bind_denoising`.
        prompt_ids: the prompt's token ids (non-empty).
        params: sampler, schedule, early stop and seed.
        max_tokens: the most tokens to generate (default 256).
        eos_token_ids: more EOS ids, added to ``{1, 106}`` (yielded with ``finish_reason="stop"``).
        context_length: the model's window: the prompt must fit, and generation stops there.
        cancel: a :class:`CancelToken`; checked between denoising steps.
        initial_canvas: the first block's starting canvas (``C`` ids); default: random.
        noise: the draw source (default: :class:`CanvasNoise` over ``RequestRNG(params.seed)``).

    Returns:
        A :class:`Generation`: tokens arrive a block at a time, once the block is final.

    Raises:
        MlxInferError: an empty prompt, a bad ``max_tokens`` or ``initial_canvas``, or a
            binding the loop cannot drive.
        PromptTooLongError: the prompt does not fit ``context_length``.
    """
    assert_denoising_graph(binding.descriptor)
    if not isinstance(params, DenoisingParams):
        raise MlxInferError(f"params must be a DenoisingParams, got {type(params).__name__}.")
    prompt_ids = [int(t) for t in prompt_ids]
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise MlxInferError(f"max_tokens must be a non-negative integer, got {max_tokens!r}.")
    if not prompt_ids:
        raise MlxInferError("The prompt is empty: give at least one token.")
    limit = max_tokens
    if context_length is not None:
        if len(prompt_ids) > context_length:
            raise PromptTooLongError(f"The prompt has {len(prompt_ids)} tokens but the model's context window is "
                                     f"{context_length} tokens. Shorten the prompt by at least "
                                     f"{len(prompt_ids) - context_length} tokens.")
        limit = min(limit, context_length - len(prompt_ids))
    C, V = binding.canvas_length, binding.vocab_size
    if initial_canvas is not None:
        canvas = mx.array(initial_canvas).astype(mx.int32).reshape(-1)
        if canvas.size != C or mx.any((canvas < 0) | (canvas >= V)).item():
            raise MlxInferError(f"initial_canvas must hold {C} token ids in [0, {V}), got shape "
                                f"{tuple(mx.array(initial_canvas).shape)}.")
        initial_canvas = canvas[None]
    noise = noise or CanvasNoise(V, C, RequestRNG(params.seed))
    eos = DEFAULT_EOS_TOKEN_IDS | frozenset(int(t) for t in eos_token_ids)
    stats = GenerateStats(prompt_tokens=len(prompt_ids))
    run = _run(binding, prompt_ids, params, limit, eos, cancel, initial_canvas, noise, stats)
    return Generation(run, stats)


def _run(binding: DenoisingBinding, prompt_ids: list[int], params: DenoisingParams, limit: int,
         eos: frozenset[int], cancel: CancelToken | None, initial_canvas: mx.array | None, noise: CanvasNoise,
         stats: GenerateStats) -> Iterator[TokenEvent]:
    mx.reset_peak_memory()
    state = None
    try:
        if limit <= 0:
            stats.finish_reason = "length"
            return
        tic = time.perf_counter()
        state = binding.prefill(mx.array(prompt_ids, dtype=mx.int32)[None])
        stats.prefill_ms = (time.perf_counter() - tic) * 1e3
        n, block = 0, None
        while True:
            tic = time.perf_counter()
            if block is not None:
                binding.extend_prefill(block, state)
            canvas = initial_canvas if block is None and initial_canvas is not None else noise.canvas()
            block = _denoise_block(binding, state, canvas, params, noise, cancel)
            stats.decode_ms += (time.perf_counter() - tic) * 1e3
            stats.cache_tokens = max(c.offset for c in state)
            if block is None:
                stats.finish_reason = "cancelled"
                return
            for token in block[0].tolist():
                finish = token_finish(eos=token in eos, complete=False, count=n + 1, limit=limit)
                stats.generated_tokens = n + 1
                stats.finish_reason = finish
                yield TokenEvent(token=token, index=n, finish_reason=finish)
                n += 1
                if finish is not None:
                    return
            if cancel is not None and cancel.cancelled:
                stats.finish_reason = "cancelled"
                return
    except GeneratorExit:
        stats.finish_reason = stats.finish_reason or "cancelled"
        raise
    finally:
        binding.close_state(state)
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9


def generate(
    loaded: "LoadedModel",
    prompt: str | list[dict[str, Any]],
    *,
    sampling: SamplingParams | None = None,
    max_tokens: int | None = None,
    stop: Iterable[str] = (),
    chat: bool = False,
    cancel: CancelToken | None = None,
) -> Generation:
    """Generate text after ``prompt`` with a loaded diffusion model; items carry their text.

    ``sampling`` gives the temperature and seed (see :func:`request_params`).
    EOS ends the generation and contributes no text; so does a stop string.
    """
    binding = bind_denoising(loaded)
    params = request_params(sampling, loaded.generation_config)
    ids = prompt_ids_for(loaded, prompt, chat=chat)
    eos = DEFAULT_EOS_TOKEN_IDS | binding.eos_token_ids
    inner = generate_denoising(binding, ids, params=params, max_tokens=max_tokens, eos_token_ids=eos,
                               context_length=loaded.context_length, cancel=cancel)
    return stream_text(dataclasses.replace(loaded, eos_token_ids=eos), inner, stop=stop)


__all__ = ["DEFAULT_EOS_TOKEN_IDS", "DEFAULT_MAX_TOKENS", "CanvasNoise", "DenoisingParams", "generate",
           "generate_denoising", "request_params"]
