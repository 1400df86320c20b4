"""``mlx-infer generate``: a prompt (or stdin, a chat, a resumed checkpoint) to text on stdout, stats on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import MlxInferError
from .common import _in_flag_words, _status, _utf8


#: Prompts shorter than this prefill in a second or two: no bar.
PREFILL_BAR_TOKENS = 1024


def _prefill_progress() -> object:
    """An ``on_prefill(done, total)`` callback drawing a tqdm bar on a terminal for long prompts (else None)."""
    if not sys.stderr.isatty():
        return None
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if total < PREFILL_BAR_TOKENS:
            return
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="mlx-infer: prompt", unit="tok", file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def _read_stdin_prompt() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MlxInferError(f"the prompt on stdin is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                            "convert it first, e.g. with iconv -t utf-8.") from None


def _check_run_dir(flag: str, value: str | None, model: str | None) -> None:
    """A --checkpoint/--resume DIR must name a directory of its own: not the current directory, one
    above it, or the model (what else a checkpoint directory may be is the checkpoint module's call)."""
    import os

    if value is None:
        return
    if not value.strip():
        raise MlxInferError(f"{flag} needs a directory path, got an empty string.")
    path = Path(os.path.realpath(Path(value).expanduser()))  # realpath never raises on symlink loops
    here = Path(os.path.realpath(Path.cwd()))
    if path == here or path in here.parents:
        raise MlxInferError(f"{flag} {value!r} is the current directory or one above it; name a directory "
                            f"of its own for the checkpoint, e.g. {flag} run1.")
    if model is not None:
        m = Path(os.path.realpath(Path(model).expanduser()))
        if path == m or path in m.parents:
            raise MlxInferError(f"{flag} {value!r} is (or holds) the model; choose a separate checkpoint directory.")


def _check_generate_args(args: argparse.Namespace) -> None:
    """The flags of ``generate`` that no library call checks before the model loads."""
    if args.prompt == "-":
        args.prompt = _read_stdin_prompt()
    _utf8("--prompt", args.prompt)
    _utf8("--system-prompt", args.system_prompt)
    for stop in args.stop or ():
        _utf8("--stop", stop)
        if not stop:
            raise MlxInferError("--stop needs a non-empty string.")
    if args.max_tokens < 0:
        raise MlxInferError(f"--max-tokens must be >= 0, got {args.max_tokens}.")
    if args.chat and args.ignore_chat_template:
        raise MlxInferError("give either --chat (require the chat template) or --ignore-chat-template, not both.")
    if args.system_prompt is not None and args.ignore_chat_template:
        raise MlxInferError("--system-prompt goes into the chat template, which --ignore-chat-template turns off; "
                            "drop one of them (or put the instructions in --prompt).")
    _check_sampling(args)
    if args.checkpoint_every < 1:
        raise MlxInferError(f"--checkpoint-every must be >= 1 token, got {args.checkpoint_every}.")
    if args.checkpoint and args.resume:
        raise MlxInferError("give either --checkpoint DIR (a new run) or --resume DIR (continue one), not both.")
    _check_run_dir("--checkpoint", args.checkpoint, args.model)
    _check_run_dir("--resume", args.resume, args.model)


def _sampling(args: argparse.Namespace) -> object:
    """The run's SamplingParams from the flags (a bad value is named by its flag)."""
    from ..sampling import SamplingParams

    rep = 1.0 if args.repetition_penalty is None else args.repetition_penalty  # 0 is refused, not "off"
    try:
        return SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              repetition_penalty=rep, seed=args.seed)
    except MlxInferError as e:
        raise MlxInferError(_in_flag_words(str(e))) from None


def _check_sampling(args: argparse.Namespace) -> None:
    if not args.resume:
        _sampling(args)


def _chat_for(args: argparse.Namespace, loaded: object) -> bool:
    """Whether the prompt goes through the chat template: as mlx-lm, whenever the model has one, unless
    --ignore-chat-template; --chat requires one. A model without one is said so, never given an invented one."""
    has_template = bool(loaded.tokenizer.chat_template)  # type: ignore[attr-defined]
    name = args.model or "the default model (Gemma 3 270M, a base model)"
    if args.chat and not has_template:
        raise MlxInferError(f"--chat: {name} has no chat template, so it cannot be prompted as a chat; drop "
                            "--chat to complete the raw prompt, or pass a chat (instruction-tuned) model.")
    if args.system_prompt is not None and not has_template:
        raise MlxInferError(f"--system-prompt: {name} has no chat template to put a system message in; put "
                            "the instructions in --prompt instead.")
    return has_template and not args.ignore_chat_template


def _generate(args: argparse.Namespace) -> int:
    from ..artifacts.loader import load_model
    from ..generation.autoregressive import generate, prompt_ids_for

    _check_generate_args(args)  # also refuses --checkpoint with --resume
    from ..parallel.serve_rank import quiet_followers

    if quiet_followers():  # under mlx.launch: rank 0 alone prints the text and the stats
        args.verbose = False
    if args.resume and any(getattr(args, f) is not None for f in ("json_schema", "regex", "grammar")):
        raise MlxInferError("--json-schema/--regex/--grammar do not work with --resume.")
    if args.resume:
        gen = _resumed(args)
    else:
        if args.prompt is None:
            raise MlxInferError("--prompt is required (only --resume DIR takes it from the checkpoint).")
        sampling = _sampling(args)
        from ..artifacts.loader import default_cpu_kernels

        cpu_kernels = False if args.stock_kernels else default_cpu_kernels()
        with _status(f"loading {args.model or 'the default model'}"):
            loaded = load_model(args.model, dtype=args.dtype, cpu_kernels=cpu_kernels)
        from .adapters import apply_generate_flags

        apply_generate_flags(args, loaded)  # --adapter-path
        chat = _chat_for(args, loaded)
        prompt = _prompt(args, chat)
        constraint = _constraint(args)
        if constraint is not None and (args.checkpoint or loaded.model.declaration.method == "denoising"):
            raise MlxInferError("--json-schema/--regex/--grammar work with plain autoregressive runs only "
                                "(not with --checkpoint, nor with a denoising model).")
        if loaded.model.declaration.method == "denoising":
            from ..generation import denoising

            if args.checkpoint:
                raise MlxInferError("--checkpoint/--resume work with autoregressive models only; this one denoises.")
            gen = denoising.generate(loaded, prompt, sampling=sampling, max_tokens=args.max_tokens, chat=chat,
                                     stop=args.stop or ())
        elif args.checkpoint:
            gen = _checkpointed(args, loaded, prompt_ids_for(loaded, prompt, chat=chat), sampling,
                                max_tokens=args.max_tokens, stop=args.stop or [], dtype=args.dtype,
                                execution={"chat": chat, "cpu_kernels": cpu_kernels})
        else:
            gen = generate(loaded, prompt, sampling=sampling, max_tokens=args.max_tokens, chat=chat,
                           stop=args.stop or (), constraint=constraint, grammar_jump=not args.no_grammar_jump,
                           on_prefill=_prefill_progress())
    interrupted = False  # Ctrl-C in a plain run: stop, then report what was generated so far
    from ..parallel.group import guarded

    with gen:
        try:
            for item in guarded(gen):  # under mlx.launch: a peer that hangs ends the run, bounded
                if item.text:
                    sys.stdout.write(item.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            interrupted = True
    s = gen.stats
    finish = "cancelled" if interrupted else s.finish_reason
    if finish != "cancelled":
        sys.stdout.write("\n")
        sys.stdout.flush()
    elif sys.stderr.isatty():  # the text stops mid-line: start the messages on a line of their own
        sys.stdout.flush()
        sys.stderr.write("\n")
    if args.verbose:
        # a resumed run that was already finished computes nothing: no memory figure to give
        peak = f"{s.peak_memory_gb:.3f} GB" if s.peak_memory_gb > 0 else "n/a (nothing computed)"
        print(f"prompt: {s.prompt_tokens} tokens, {s.prefill_tps:.2f} tokens/s\n"
              f"generation: {s.generated_tokens} tokens, {s.decode_tps:.2f} tokens/s\n"
              f"peak memory: {peak}\nfinish: {finish}", file=sys.stderr)
    if finish == "cancelled":
        resume = args.checkpoint or args.resume
        print(f"mlx-infer: interrupted; resume with --resume {resume}" if resume else "mlx-infer: interrupted",
              file=sys.stderr)
        return 130
    return 0


def _constraint(args: argparse.Namespace) -> object:
    """The structured-output constraint of ``--json-schema FILE`` / ``--regex`` / ``--grammar FILE``, or None."""
    given = [f for f in ("json_schema", "regex", "grammar") if getattr(args, f) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise MlxInferError(f"give one of --json-schema, --regex, --grammar, not {len(given)} of them.")
    from ..constraints import Constraint

    if args.regex is not None:
        return Constraint.regex(args.regex).validate()
    flag, path = ("--json-schema", args.json_schema) if args.json_schema is not None else ("--grammar", args.grammar)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise MlxInferError(f"{flag} {path}: cannot read the file ({getattr(e, 'strerror', None) or e}).") from None
    try:
        c = Constraint.json_schema(text) if flag == "--json-schema" else Constraint.grammar(text)
        return c.validate()
    except MlxInferError as e:
        raise MlxInferError(f"{flag} {path}: {e}") from None


def _prompt(args: argparse.Namespace, chat: bool) -> object:
    if chat and args.system_prompt:
        return [{"role": "system", "content": args.system_prompt}, {"role": "user", "content": args.prompt}]
    return args.prompt


def _resumed(args: argparse.Namespace) -> object:
    """``--resume DIR``: the checkpoint holds the prompt and every setting; flags given too must match it."""
    from ..artifacts.loader import load_model
    from ..generation.autoregressive import prompt_ids_for
    from ..generation.checkpoint import read_checkpoint

    ck = read_checkpoint(args.resume)
    sampling, execution = ck.sampling(), ck.execution
    from . import build_parser

    flag_defaults = vars(build_parser().parse_args(["generate"]))
    saved = {
        "temp": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty, "seed": sampling.seed, "max_tokens": ck.max_tokens,
        "stop": ck.stop, "chat": execution.get("chat", False), "dtype": ck.dtype,
        "ignore_chat_template": not execution.get("chat", False),
        "stock_kernels": execution.get("cpu_kernels") is False,
    }
    given = {k: getattr(args, k) for k in saved if getattr(args, k) != flag_defaults[k]}
    if given.get("repetition_penalty") is not None:
        given["repetition_penalty"] = float(given["repetition_penalty"])
    differ = [f"--{k.replace('_', '-')} ({v!r} given, {saved[k]!r} saved)" for k, v in given.items()
              if v != saved[k] and not (k in ("temp", "top_p", "min_p") and float(v) == saved[k])]
    if differ:
        verb, them = ("differs", "it") if len(differ) == 1 else ("differ", "them")
        raise MlxInferError(f"--resume {args.resume}: {', '.join(differ)} {verb} from the checkpoint; drop {them} "
                            "(the checkpoint holds the run's settings) or start a new run with --checkpoint.")
    model = args.model if args.model is not None else ck.model
    cpu_kernels = execution.get("cpu_kernels")  # the kernels the run used: they change the numerics
    with _status(f"loading {model or 'the default model'}"):
        loaded = load_model(model, dtype=ck.dtype,
                            cpu_kernels=cpu_kernels if isinstance(cpu_kernels, bool) else None)
    if loaded.model.declaration.method == "denoising":
        raise MlxInferError("--checkpoint/--resume work with autoregressive models only; this one denoises.")
    from .adapters import apply_generate_flags

    apply_generate_flags(args, loaded)  # --adapter-path: checked against the checkpoint's adapter
    if args.prompt is not None:
        if prompt_ids_for(loaded, _prompt(args, saved["chat"]), chat=saved["chat"]) != ck.prompt_ids:
            raise MlxInferError(f"--resume {args.resume}: --prompt differs from the checkpoint's prompt; drop "
                                "--prompt (the checkpoint holds it) or start a new run with --checkpoint.")
    return _checkpointed(args, loaded, ck.prompt_ids, sampling, max_tokens=ck.max_tokens, stop=ck.stop,
                         dtype=ck.dtype, execution=execution)


def _checkpointed(args: argparse.Namespace, loaded: object, prompt_ids: list[int], sampling: object, *,
                  max_tokens: int, stop: list[str], dtype: str | None, execution: dict[str, object]) -> object:
    """A checkpointed run; Ctrl-C (SIGINT) stops it at the next token and saves."""
    import signal

    from ..generation.checkpoint import generate_checkpointed
    from ..generation.stopping import CancelToken

    cancel = CancelToken()
    signal.signal(signal.SIGINT, lambda *_: cancel.cancel())
    return generate_checkpointed(
        loaded, prompt_ids, args.checkpoint or args.resume, sampling=sampling, max_tokens=max_tokens,
        stop=stop, resume=bool(args.resume), every=args.checkpoint_every, dtype=dtype,
        cancel=cancel, execution=execution,
    )
