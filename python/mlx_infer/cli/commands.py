"""``mlx-infer convert | bench | serve``: each a thin call into the library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import MlxInferError
from .common import _in_flag_words, _status, _utf8


def _convert(args: argparse.Namespace) -> int:
    from ..artifacts.convert import convert

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
    from ..artifacts.default_model import default_model_gguf
    from ..artifacts.loader import converted_gguf_dir, is_gguf
    from ..bench import BenchConfig, make_engine, results_document, run_bench, write_markdown, write_plot
    from ..bench.engines import ENGINES
    from ..bench.report import write_json
    from ..bench.runner import model_facts

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
        from ..server import ServeOptions, serve
    except ImportError:
        raise MlxInferError("serve needs the server extra: pip install 'mlx-infer[server]'.") from None
    from .adapters import parse_loras

    public = tuple(p.strip() for p in args.public.split(",") if p.strip()) if args.public is not None else None
    template = args.chat_template
    if template is not None and "{" not in template and Path(template).expanduser().is_file():
        template = _utf8("--chat-template", Path(template).expanduser().read_text(encoding="utf-8", errors="replace"))
    serve(ServeOptions(model=args.model, host=args.host, port=args.port, max_batch=args.max_batch,
                       memory_budget_gb=args.memory_budget, preallocate_kv=args.preallocate_kv,
                       api_key=args.api_key, max_tokens=args.max_tokens,
                       prefill_step_size=args.prefill_step_size, log_level=args.log_level,
                       drain_timeout_s=args.drain_timeout, header_timeout_s=args.header_timeout,
                       body_timeout_s=args.body_timeout, served_model_name=args.served_model_name,
                       allowed_origins=tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()),
                       temp=args.temp, top_p=args.top_p, top_k=args.top_k,
                       min_p=args.min_p, chat_template=template, grammar_jump=not args.no_grammar_jump,
                       loras=tuple(parse_loras(args.lora)), max_loras=args.max_loras,
                       engine_process=not args.no_engine_process,
                       **({"public": public} if public is not None else {})))
    return 0
