"""``mlx-infer generate | serve | convert | bench`` — thin over the library.

Flags follow ``mlx_lm.generate`` / ``mlx_lm.convert`` where the verbs overlap.
Generated text goes to stdout; stats, progress and errors go to stderr.
Bad input exits with status 2 and a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from contextlib import contextmanager
from typing import Iterator, NoReturn, Sequence

from . import defaults
from .artifacts.default_model import DEFAULT_VARIANT
from .errors import MlxInferError


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ... (see prog --help)``), exit 2,
    and whose ``--help`` shows every default."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _utf8(flag: str, text: str | None) -> str | None:
    """``text`` unless it holds bytes that were not UTF-8 (Python maps them to lone surrogates)."""
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise MlxInferError(f"{flag} is not valid UTF-8 text; pass it UTF-8 encoded.") from None
    return text


@contextmanager
def _status(what: str) -> Iterator[None]:
    """``mlx-infer: WHAT...`` on stderr while the block runs (a terminal only; the line is cleared after)."""
    if not sys.stderr.isatty():
        yield
        return
    line = f"mlx-infer: {what}..."
    sys.stderr.write(line)
    sys.stderr.flush()
    try:
        yield
    finally:
        sys.stderr.write("\r" + " " * len(line) + "\r")
        sys.stderr.flush()


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


#: SamplingParams field -> the generate/serve flag that sets it (so messages name what the user typed).
_SAMPLING_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                   "repetition_penalty": "--repetition-penalty", "seed": "--seed"}


def _in_flag_words(message: str) -> str:
    """A library message in the CLI's words: ``SamplingParams.top_p`` -> ``--top-p``, ``overwrite=True`` ->
    ``--overwrite``."""
    import re

    message = re.sub(r"SamplingParams\.(\w+)", lambda m: _SAMPLING_FLAGS.get(m.group(1), m.group(0)), message)
    message = re.sub(r"^group_size must be", "--q-group-size must be", message)
    return message.replace("pass overwrite=True (--overwrite)", "pass --overwrite")


def _sampling(args: argparse.Namespace) -> object:
    """The run's SamplingParams from the flags (a bad value is named by its flag)."""
    from .sampling import SamplingParams

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
    from .artifacts.loader import load_model
    from .generation.autoregressive import generate, prompt_ids_for

    _check_generate_args(args)  # also refuses --checkpoint with --resume
    if args.resume and any(getattr(args, f) is not None for f in ("json_schema", "regex", "grammar")):
        raise MlxInferError("--json-schema/--regex/--grammar do not work with --resume.")
    if args.resume:
        gen = _resumed(args)
    else:
        if args.prompt is None:
            raise MlxInferError("--prompt is required (only --resume DIR takes it from the checkpoint).")
        sampling = _sampling(args)
        from .artifacts.loader import default_cpu_kernels

        cpu_kernels = False if args.stock_kernels else default_cpu_kernels()
        with _status(f"loading {args.model or 'the default model'}"):
            loaded = load_model(args.model, dtype=args.dtype, cpu_kernels=cpu_kernels)
        from .cli_adapters import apply_generate_flags

        apply_generate_flags(args, loaded)  # --adapter-path
        chat = _chat_for(args, loaded)
        prompt = _prompt(args, chat)
        constraint = _constraint(args)
        if constraint is not None and (args.checkpoint or loaded.model.declaration.method == "denoising"):
            raise MlxInferError("--json-schema/--regex/--grammar work with plain autoregressive runs only "
                                "(not with --checkpoint, nor with a denoising model).")
        if loaded.model.declaration.method == "denoising":
            from .generation import denoising

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
    with gen:
        try:
            for item in gen:
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
    from .constraints import Constraint

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
    from .artifacts.loader import load_model
    from .generation.autoregressive import prompt_ids_for
    from .generation.checkpoint import read_checkpoint

    ck = read_checkpoint(args.resume)
    sampling, execution = ck.sampling(), ck.execution
    defaults = vars(build_parser().parse_args(["generate"]))
    saved = {
        "temp": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty, "seed": sampling.seed, "max_tokens": ck.max_tokens,
        "stop": ck.stop, "chat": execution.get("chat", False), "dtype": ck.dtype,
        "ignore_chat_template": not execution.get("chat", False),
        "stock_kernels": execution.get("cpu_kernels") is False,
    }
    given = {k: getattr(args, k) for k in saved if getattr(args, k) != defaults[k]}
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
    from .cli_adapters import apply_generate_flags

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

    from .generation.checkpoint import generate_checkpointed
    from .generation.stopping import CancelToken

    cancel = CancelToken()
    signal.signal(signal.SIGINT, lambda *_: cancel.cancel())
    return generate_checkpointed(
        loaded, prompt_ids, args.checkpoint or args.resume, sampling=sampling, max_tokens=max_tokens,
        stop=stop, resume=bool(args.resume), every=args.checkpoint_every, dtype=dtype,
        cancel=cancel, execution=execution,
    )


def _convert(args: argparse.Namespace) -> int:
    from .artifacts.convert import convert

    if args.q_bits not in (4, 8):
        raise MlxInferError(f"--q-bits takes 4 or 8 bits, got {args.q_bits}.")
    try:
        out = convert(Path(args.model), Path(args.mlx_path), quantize_bits=args.q_bits if args.quantize else None,
                      group_size=args.q_group_size, dtype=args.dtype, overwrite=args.overwrite,
                      progress=sys.stderr.isatty())
    except OSError as e:  # disk full, permissions: the partial output is already removed
        raise MlxInferError(f"convert failed writing {args.mlx_path}: {e.strerror or e}.") from None
    except MlxInferError as e:
        raise type(e)(_in_flag_words(str(e))) from None
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _check_output_file(flag: str, value: str | None) -> None:
    """An output file flag must name a file that can be created (checked before the slow run)."""
    if value is None:
        return
    path = Path(value).expanduser()
    if not value.strip() or path.is_dir():
        raise MlxInferError(f"{flag} {value!r} is a directory (or empty); give a file path.")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise MlxInferError(f"{flag} {value!r}: {str(parent)!r} is a file, so the output cannot be created there.")


def _bench(args: argparse.Namespace) -> int:
    from .artifacts.default_model import default_model_gguf
    from .artifacts.loader import converted_gguf_dir, is_gguf
    from .bench import BenchConfig, make_engine, results_document, run_bench, write_markdown, write_plot
    from .bench.engines import ENGINES
    from .bench.report import write_json
    from .bench.runner import model_facts

    config = BenchConfig(prompt_tokens=args.prompt_tokens, generation_tokens=args.generation_tokens,
                         batch_size=args.batch_size, num_trials=args.num_trials,
                         prefill_step_size=args.prefill_step_size)
    names = ["mlx-infer-stock" if args.stock_kernels else "mlx-infer",
             *[c.strip() for c in (args.compare or "").split(",") if c.strip()]]
    if len(set(names)) != len(names):
        raise MlxInferError(f"--compare names an engine twice: {args.compare}")
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise MlxInferError(f"--compare: unknown engine {unknown[0]!r}; choose from {', '.join(ENGINES)}.")
    for flag, value in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        _check_output_file(flag, value)
    if args.model:
        source = Path(args.model).expanduser()
    else:
        with _status("preparing the default model"):  # the first run assembles its GGUF (~250 MB)
            source = default_model_gguf()
    if not source.exists():
        raise MlxInferError(f"Model path {str(source)!r} does not exist.")
    gguf = source if is_gguf(source) else None
    model_dir = converted_gguf_dir(gguf) if gguf else source
    model_name, vocab = model_facts(model_dir)
    if gguf is not None:
        model_name = gguf.stem
    n_ctx = config.prompt_tokens + config.generation_tokens + 16
    engines = []
    for n in names:
        with _status(f"loading {n}"):
            engines.append(make_engine(n, model=str(model_dir), model_dir=model_dir, gguf_path=gguf, n_ctx=n_ctx))
    from tqdm import tqdm

    try:  # tqdm.write: each trial's line goes above the bar (terminal only), not through it
        rows = run_bench(engines, config, model_name=model_name, vocab_size=vocab,
                         on_trial=lambda e, i, r: tqdm.write(
                             f"trial {i + 1} {e}: prompt {r.prompt_tps:.1f} tok/s, ttft {r.ttft_ms:.0f} ms, "
                             f"decode {r.decode_tps:.2f} tok/s, peak {r.peak_gb:.2f} GB", file=sys.stderr))
    finally:
        for e in engines:
            e.close()
    doc = results_document(rows)
    print(write_markdown(doc, Path(args.markdown) if args.markdown else None))
    if args.json:
        write_json(doc, Path(args.json))
    if args.plot:
        with _status("drawing the plot"):  # matplotlib's first import takes seconds
            write_plot(doc, Path(args.plot))
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from .server import ServeOptions, serve
    except ImportError:
        raise MlxInferError("serve needs the server extra: pip install 'mlx-infer[server]'.") from None
    from .cli_adapters import parse_loras

    public = tuple(p.strip() for p in args.public.split(",") if p.strip()) if args.public is not None else None
    template = args.chat_template
    if template is not None and "{" not in template and Path(template).expanduser().is_file():
        template = _utf8("--chat-template", Path(template).expanduser().read_text(encoding="utf-8", errors="replace"))
    serve(ServeOptions(model=args.model, host=args.host, port=args.port, max_batch=args.max_batch,
                       memory_budget_gb=args.memory_budget, api_key=args.api_key, max_tokens=args.max_tokens,
                       prefill_step_size=args.prefill_step_size, log_level=args.log_level,
                       drain_timeout_s=args.drain_timeout, header_timeout_s=args.header_timeout,
                       body_timeout_s=args.body_timeout, served_model_name=args.served_model_name,
                       allowed_origins=tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()),
                       temp=args.temp, top_p=args.top_p, top_k=args.top_k,
                       min_p=args.min_p, chat_template=template, grammar_jump=not args.no_grammar_jump,
                       loras=tuple(parse_loras(args.lora)), max_loras=args.max_loras,
                       **({"public": public} if public is not None else {})))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = _Parser(prog="mlx-infer", description="Run language models on MLX.",
                epilog="Run 'mlx-infer COMMAND --help' for a command's options.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", default=None,
                   help="model directory or .gguf file (none: the embedded Gemma 3 270M, cached in "
                        f"{DEFAULT_VARIANT}; see 'mlx-infer cache')")
    g.add_argument("--prompt", "-p", default=None,
                   help="the prompt text ('-' reads stdin); --resume DIR takes it from the checkpoint")
    g.add_argument("--max-tokens", "-m", type=int, default=defaults.CLI_MAX_TOKENS, help="most tokens to generate")
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, default=None, help="penalty for repeated tokens (>1)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--system-prompt", default=None, help="system message (needs a model with a chat template)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (none: fresh)")
    g.add_argument("--chat", action="store_true",
                   help="require the model's chat template (it applies by default whenever the model has one)")
    g.add_argument("--ignore-chat-template", action="store_true",
                   help="complete the raw prompt even when the model has a chat template (as mlx-lm's flag)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to JSON valid under this JSON Schema file")
    g.add_argument("--regex", default=None, metavar="PATTERN", help="constrain the whole output to match a regex")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="constrain the output to a grammar file (Lark, or llama.cpp GBNF)")
    g.add_argument("--no-grammar-jump", action="store_true",
                   help="feed tokens the constraint forces one decode step each (default: one forward per span)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast weights to this dtype (with the default model, float32 loads its float32 "
                        "reference instead of the cached variant)")
    g.add_argument("--stock-kernels", action="store_true",
                   help="MLX's stock CPU kernels instead of mlx-infer's (bit-exact with mlx-lm)")
    g.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="save a resumable checkpoint to DIR as it goes and on Ctrl-C")
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run checkpointed in DIR with its prompt and settings (flags given too "
                        "must match them); prints only what follows")
    g.add_argument("--checkpoint-every", type=int, default=16, help="tokens between checkpoint saves")
    g.add_argument("--verbose", type=_str2bool, default=True, metavar="BOOL",
                   help="print stats on stderr (false/f/0/no/off turn them off; anything else is true, as mlx-lm)")
    from .cli_adapters import add_fuse_parser, add_generate_flags, add_serve_flags

    add_generate_flags(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible API (continuous batching)")
    s.add_argument("--model", default=None, help="model directory or .gguf file (none: the embedded Gemma 3 270M)")
    s.add_argument("--host", default=defaults.HOST, help="bind address (loopback only unless told)")
    s.add_argument("--port", type=int, default=defaults.PORT, help="TCP port")
    s.add_argument("--max-batch", type=int, default=defaults.MAX_BATCH, help="most requests running at once")
    s.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help="memory for KV pages and activations, weights excluded (default: sized from the "
                        "device: 0.9 of a GPU's memory or 0.25 of available RAM, minus what this and other "
                        "processes hold and an activation reserve)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but the --public ones")
    s.add_argument("--public", default=None, metavar="LIST",
                   help="with --api-key, endpoints open without it: comma list of health, metrics, docs "
                        "(none given: health; '' for none)")
    s.add_argument("--max-tokens", type=int, default=defaults.SERVER_MAX_TOKENS,
                   help="default max tokens of a chat completion, and the most any request may ask")
    s.add_argument("--prefill-step-size", type=int, default=defaults.ENGINE_PREFILL_STEP_SIZE, help="prompt tokens per engine iteration")
    s.add_argument("--drain-timeout", type=float, default=defaults.DRAIN_TIMEOUT_S, metavar="S",
                   help="on Ctrl-C/SIGTERM, seconds requests in flight get to finish before they are aborted")
    s.add_argument("--header-timeout", type=float, default=defaults.HEADER_TIMEOUT_S, metavar="S",
                   help="seconds a client may take to send a request's headers")
    s.add_argument("--body-timeout", type=float, default=defaults.BODY_TIMEOUT_S, metavar="S",
                   help="seconds a client may take to send a request's body")
    s.add_argument("--log-level", default="info", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug"], help="server log level (any case)")
    s.add_argument("--temp", type=float, default=None,
                   help="default temperature of requests that give none (none: the model's generation_config)")
    s.add_argument("--top-p", type=float, default=None, help="default top_p (none: the model's)")
    s.add_argument("--top-k", type=int, default=None, help="default top_k (none: the model's)")
    s.add_argument("--min-p", type=float, default=None, help="default min_p (none: the model's)")
    s.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="Jinja chat template (or a file holding one) for /v1/chat/completions, e.g. for a "
                        "base model (none: the model's own; a model without one answers chat with a 400)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients pass (default: the model's directory or file name)")
    s.add_argument("--allowed-origins", default=None, metavar="LIST",
                   help="CORS: comma-separated origins to answer ('*' for any; default: CORS off)")
    s.add_argument("--no-grammar-jump", action="store_true",
                   help="feed tokens a constraint forces one decode step each (default: one forward per span)")
    add_serve_flags(s)
    s.set_defaults(func=_serve)

    c = sub.add_parser("convert", help="write a GGUF or HF model as an MLX directory")
    c.add_argument("--model", "--hf-path", dest="model", required=True, help="source .gguf file or HF directory")
    c.add_argument("--mlx-path", "-o", default="mlx_model", help="output directory")
    c.add_argument("--quantize", "-q", action="store_true", help="quantize the weights (affine, --q-bits)")
    c.add_argument("--q-bits", type=int, default=4, help="bits per quantized weight: 4 or 8 (with -q)")
    c.add_argument("--q-group-size", type=int, default=64, help="quantization group size (with -q)")
    c.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of unquantized weights")
    c.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    c.set_defaults(func=_convert)

    b = sub.add_parser("bench", help="benchmark against mlx-lm (and llama.cpp) in one run")
    b.add_argument("--model", default=None, help="model directory or .gguf (default: the embedded model)")
    b.add_argument("--prompt-tokens", "-p", type=int, default=512, help="prompt length")
    b.add_argument("--generation-tokens", "-g", type=int, default=1024, help="tokens to generate")
    b.add_argument("--batch-size", "-b", type=int, default=1, help="batch size")
    b.add_argument("--num-trials", "-n", type=int, default=5, help="timed trials per engine")
    b.add_argument("--prefill-step-size", type=int, default=defaults.PREFILL_STEP_SIZE, help="prompt tokens per prefill chunk")
    b.add_argument("--compare", default=None, help="engines to compare with: mlx-lm[,llama.cpp]")
    b.add_argument("--stock-kernels", action="store_true",
                   help="run mlx-infer on MLX's stock CPU kernels (engine mlx-infer-stock)")
    b.add_argument("--json", default=None, help="write results JSON here")
    b.add_argument("--markdown", default=None, help="write a markdown table here")
    b.add_argument("--plot", default=None, help="write a PNG plot here")
    b.set_defaults(func=_bench)

    from .cli_cache import add_cache_parser

    add_cache_parser(sub)
    add_fuse_parser(sub)
    return p


def _str2bool(text: str) -> bool:
    """mlx-lm's reading of ``--verbose``: false unless the word says so."""
    return text.strip().lower() not in ("false", "f", "0", "no", "n", "off")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-infer")
    except PackageNotFoundError:  # run from a source tree (PYTHONPATH)
        return "0.1.0 (source tree)"


def _stdout_closed() -> int:
    """stdout's reader went away (``| head``): end quietly, as a shell tool killed by SIGPIPE would."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush must not raise again
    except (OSError, ValueError):
        pass
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlx-infer`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        print("mlx-infer: give a command: generate, serve, convert, bench or cache, e.g. mlx-infer generate "
              "--prompt 'The capital of France is' (see mlx-infer --help)", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:
        return _stdout_closed()
    except ValueError as e:  # MlxInferError and the library's other ValueError subclasses: bad input
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"mlx-infer: error: {message}", file=sys.stderr)
        return 2
    except OSError as e:  # a path given on the command line that cannot be read or written
        where = f": {e.filename}" if e.filename else ""
        print(f"mlx-infer: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmlx-infer: interrupted" if sys.stderr.isatty() else "mlx-infer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
