"""``mlx-infer generate | serve | convert | bench`` — thin over the library.

Flags follow ``mlx_lm.generate`` / ``mlx_lm.convert`` where the verbs overlap.
Generated text goes to stdout; stats, progress and errors go to stderr.
Bad input exits with status 2 and a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .. import defaults
from ..artifacts.default_model import DEFAULT_VARIANT
from .commands import _bench, _convert, _serve
from .common import _Parser
from .generate import _generate


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
    from .adapters import add_fuse_parser, add_generate_flags, add_serve_flags

    add_generate_flags(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible API (continuous batching)")
    s.add_argument("--model", default=None, help="model directory or .gguf file (none: the embedded Gemma 3 270M)")
    s.add_argument("--host", default=defaults.HOST, help="bind address (loopback only unless told)")
    s.add_argument("--port", type=int, default=defaults.PORT, help="TCP port")
    s.add_argument("--max-batch", type=int, default=None,
                   help=f"most requests running at once (default: {defaults.MAX_BATCH['gpu']} on a GPU, "
                        f"{defaults.MAX_BATCH['cpu']} on a CPU)")
    s.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help="memory for KV pages and activations, weights excluded (default: sized from the "
                        "device: 0.8 of a GPU's memory or 0.25 of available RAM, minus what this and other "
                        "processes hold and an activation reserve); the KV pool's cap: its storage "
                        "grows on demand up to it")
    s.add_argument("--preallocate-kv", action="store_true",
                   help="allocate the KV pool's whole cap at start instead of growing it on demand")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but the --public ones")
    s.add_argument("--public", default=None, metavar="LIST",
                   help="with --api-key, endpoints open without it: comma list of health, metrics, docs "
                        "(none given: health; '' for none)")
    s.add_argument("--max-tokens", type=int, default=defaults.SERVER_MAX_TOKENS,
                   help="default max tokens of a chat completion, and the most any request may ask")
    s.add_argument("--prefill-step-size", type=int, default=None,
                   help=f"prompt tokens per engine iteration (default: {defaults.ENGINE_PREFILL_STEP_SIZE['gpu']} on "
                        f"a GPU, {defaults.ENGINE_PREFILL_STEP_SIZE['cpu']} on a CPU)")
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
    s.add_argument("--no-engine-process", action="store_true",
                   help="run the engine as a thread of the server's process (default: a process of its own, so "
                        "streaming responses and stepping the model do not share one GIL)")
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

    from .cache import add_cache_parser

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
    except RuntimeError as e:  # under mlx.launch, a peer that died: one line, not a traceback
        from ..parallel.group import current_group, fail_group, is_peer_failure

        if not is_peer_failure(e):
            raise
        fail_group(current_group(), f"mlx-infer {args.command} lost a peer", e)


if __name__ == "__main__":
    sys.exit(main())
