"""The bench machinery on a tiny random model: fields, alternation, files (not speed)."""

import json
import pathlib
import subprocess
import sys

import pytest
from tiny import make_tiny_model_dir

from mlx_infer.bench import BenchConfig, make_engine, results_document, run_bench
from mlx_infer.bench.report import RESULTS_SCHEMA_KEYS, ROW_KEYS
from mlx_infer.errors import MlxInferError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("bench") / "gemma3", "gemma3")


def test_engines_alternate_and_rows_follow_the_schema(tiny_dir):
    engines = [make_engine(n, model=str(tiny_dir), model_dir=tiny_dir, gguf_path=None, n_ctx=64)
               for n in ("mlx-infer", "mlx-lm")]
    order = []
    config = BenchConfig(prompt_tokens=16, generation_tokens=8, num_trials=3)
    rows = run_bench(engines, config, model_name="tiny", vocab_size=320, progress=False,
                     on_trial=lambda e, i, r: order.append((i, e)))
    assert order == [(0, "mlx-infer"), (0, "mlx-lm"), (1, "mlx-lm"), (1, "mlx-infer"),
                     (2, "mlx-infer"), (2, "mlx-lm")]
    assert [r["engine"] for r in rows] == ["mlx-infer", "mlx-lm"]
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
        assert len(r["trials"]) == 3
        assert r["decode_tps_min"] <= r["decode_tps"] <= r["decode_tps_max"]
        assert r["decode_tps"] > 0 and r["prompt_tps"] > 0 and r["ttft_ms"] > 0
    ratio = rows[1]["ratio_vs_mlx-infer"]
    assert len(ratio["decode_tps"]) == 3 and ratio["decode_tps_median"] > 0
    doc = results_document(rows, command="test")
    assert tuple(doc) == RESULTS_SCHEMA_KEYS
    assert doc["versions"]["mlx"] and doc["versions"]["mlx-lm"]


def test_batched_bench_reports_aggregate_throughput(tiny_dir):
    engines = [make_engine("mlx-infer", model=str(tiny_dir), model_dir=tiny_dir, gguf_path=None, n_ctx=64)]
    rows = run_bench(engines, BenchConfig(prompt_tokens=8, generation_tokens=6, batch_size=4, num_trials=1),
                     model_name="tiny", vocab_size=320, progress=False)
    assert rows[0]["batch"] == 4 and rows[0]["decode_tps"] > 0


def test_bad_bench_settings():
    with pytest.raises(MlxInferError, match="--num-trials must be >= 1"):
        BenchConfig(num_trials=0)
    with pytest.raises(MlxInferError, match="Unknown engine"):
        make_engine("vllm", model=None, model_dir=None, gguf_path=None, n_ctx=8)


def test_cli_writes_json_markdown_and_png(tiny_dir, tmp_path):
    out = tmp_path / "r"
    r = subprocess.run([sys.executable, "-m", "mlx_infer", "bench", "--model", str(tiny_dir), "--compare", "mlx-lm",
                        "-p", "16", "-g", "8", "-n", "2", "--json", str(out / "r.json"),
                        "--markdown", str(out / "r.md"), "--plot", str(out / "r.png")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "r.json").read_text())
    assert [row["engine"] for row in doc["rows"]] == ["mlx-infer", "mlx-lm"]
    assert "| mlx-lm |" in (out / "r.md").read_text()
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # stderr is a pipe: the trial lines, no progress bar or status line (tests/test_cli_terminal.py: a terminal)
    assert "\r" not in r.stderr and "warm-up" not in r.stderr and "loading" not in r.stderr, r.stderr
    assert [ln.split(":")[0] for ln in r.stderr.splitlines() if ln.startswith("trial ")] == [
        "trial 1 mlx-infer", "trial 1 mlx-lm", "trial 2 mlx-lm", "trial 2 mlx-infer"], r.stderr


def test_served_benchmark_on_a_toy_shape_writes_ttft_memory_json_and_plot(tmp_path):
    """benchmarks/served.py --shape: random weights of a real shape (toy sizes), the in-process
    engine, the HTTP server and mlx-lm; TTFT percentiles and peak memory per row."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "served.py"
    out = tmp_path / "served.json"
    r = subprocess.run([sys.executable, str(script), "--shape", "gemma3-270m", "--toy", "--streams", "1,2",
                        "-p", "8", "-g", "4", "-r", "1", "-n", "1", "--http", "--no-ids", "--memory-budget", "0.25",
                        "--json", str(out),
                        "--plot", str(tmp_path / "served.png")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch"], row["engine"]) for row in rows] == [
        (s, e) for s in (1, 2) for e in ("mlx-infer", "mlx-lm", "mlx-infer-http")]
    for row in rows:
        assert row["decode_tps"] > 0 and row["trials"][0]["tokens"] == 4 * row["batch"]
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"]
        assert len(row["trials"][0]["ttft_s"]) == row["batch"]  # one first token per request
        assert row["peak_gb"] > 0
        assert row["warmup_trials"] == 1 and row["gpu_sharing"]
        if row["engine"] == "mlx-infer":  # the pool was allocated (0.8 of --memory-budget at most)
            assert 0 < row["kv_pool_gb"] and 0 < row["weights_gb"] < row["peak_gb"] and row["kv_pool_tokens"] > 0
            # its own peak: at least its weights and storage, at most the process's
            assert row["weights_gb"] + row["kv_pool_gb"] <= row["own_peak_gb"] + 1e-9 <= row["peak_gb"] + 1e-6
            assert row["kv_sizing"] == "--memory-budget 0.25 each"
        trial = row["trials"][0]
        if row["engine"] == "mlx-lm":
            assert 0 < row["own_peak_gb"] <= row["peak_gb"] + 1e-6
            assert row["engine_ttft_mean_ms"] is None and trial["ttft_mean_ms"] > 0
            assert row["engine_itl_mean_ms"] is None
        else:  # the engine's own TTFT (its /metrics histogram for the server) lies inside the client's
            assert 0 < row["engine_ttft_mean_ms"] == trial["engine_ttft_mean_ms"] <= trial["ttft_mean_ms"]
            # and its mean inter-token latency (4 tokens a request: 3 gaps each), shorter than a request's decode
            assert 0 < row["engine_itl_mean_ms"] == trial["engine_itl_mean_ms"] < trial["wall_s"] * 1e3
        if row["engine"] == "mlx-infer-http":  # the server's own first-chunk time lies between the two
            assert trial["engine_ttft_mean_ms"] <= trial["server_first_chunk_mean_ms"] <= trial["ttft_mean_ms"]
        if row["engine"] == "mlx-infer-http":  # its own phase, its pool from its startup line
            assert row["gpu_sharing"].startswith("own phase") and "KV pages of" in row["kv_pool"]
    assert "| TTFT p50 ms | TTFT p95 ms | peak GB (process / own) |" in r.stdout
    assert (tmp_path / "served.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_served_benchmark_http_beside_shares_the_phase_and_the_sizing(tmp_path):
    """--http --http-beside: the server runs in the in-process phase, trials alternating, its pool one
    more equal share of the default sizing (the in-process engine's budget, recorded in its rows)."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "served.py"
    out = tmp_path / "served.json"
    r = subprocess.run([sys.executable, str(script), "--shape", "gemma3-270m", "--toy", "--streams", "2",
                        "-p", "8", "-g", "2", "-r", "1", "-n", "1", "--http", "--http-beside", "--no-ids",
                        "--http-clients", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["mlx-infer", "mlx-infer-http", "mlx-lm"]
    assert rows["mlx-infer"]["kv_sizing"].startswith("1/2 of the default device sizing each")
    http = rows["mlx-infer-http"]
    assert http["kv_sizing"] == rows["mlx-infer"]["kv_sizing"] and "beside them" in http["gpu_sharing"]
    assert "KV pages of" in http["kv_pool"] and http["trials"][0]["tokens"] == 4
    assert http["http_clients"] == 2 and http["streams_per_client"] == 1  # --http-clients: one stream each


def test_http_clients_spread_a_trial():
    """A trial's streams go to as few client processes as keep each within its share (--http-clients)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from served_http import client_parts

    assert client_parts(32, 2, 16) == 2 and client_parts(8, 2, 16) == 1  # the default: 16 streams a client
    assert client_parts(32, 8, 4) == 8 and client_parts(8, 8, 4) == 2 and client_parts(1, 8, 4) == 1
    assert client_parts(128, 8, 16) == 8


def test_served_benchmark_http_thread_and_generate_step_columns(tmp_path):
    """--http-thread: the server with its engine as a thread (--no-engine-process) beside the default one, each
    its own equal share; --mlx-lm-step: mlx-lm's generate_step in the 1-stream rows only; --no-prefetch: a
    token-ids column with the step plan's GPU prefetch off (MLX_INFER_PREFETCH_PLAN=0 while it runs);
    --env-column: a token-ids column with the given variables set while it runs."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "served.py"
    out = tmp_path / "served.json"
    r = subprocess.run([sys.executable, str(script), "--shape", "gemma3-270m", "--toy", "--streams", "1,2",
                        "-p", "8", "-g", "3", "-r", "1", "-n", "1", "--http", "--http-beside", "--http-thread",
                        "--mlx-lm-step", "--no-prefetch", "--no-text", "--env-column", "MLX_INFER_FUSED_GATED=1,MLX_INFER_X=2",
                        "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by = {(row["batch"], row["engine"]): row for row in rows}
    ours = ["mlx-infer-http", "mlx-infer-http-thread", "mlx-infer-ids", "mlx-infer-ids-noprefetch",
            "mlx-infer-ids[MLX_INFER_FUSED_GATED=1,MLX_INFER_X=2]"]
    assert sorted(e for s, e in by if s == 1) == ours + ["mlx-lm", "mlx-lm-step"]
    assert sorted(e for s, e in by if s == 2) == ours + ["mlx-lm"]
    assert by[(2, "mlx-infer-ids-noprefetch")]["trials"][0]["tokens"] == 6
    assert by[(2, "mlx-infer-ids[MLX_INFER_FUSED_GATED=1,MLX_INFER_X=2]")]["trials"][0]["tokens"] == 6
    for name in ("mlx-infer-http", "mlx-infer-http-thread"):
        row = by[(2, name)]
        assert row["kv_sizing"].startswith("1/5 of the default device sizing each") and "KV pages of" in row["kv_pool"]
        assert row["trials"][0]["tokens"] == 6
    assert by[(1, "mlx-lm-step")]["trials"][0]["tokens"] == 3


def test_env_columns_hold_their_variables_while_their_engine_is_built_and_runs(monkeypatch):
    """served.py's --env-column: the variables are set while the column's engine is built (knobs an engine
    reads then, such as MLX_INFER_CEILING_LAYERS) and while it runs, and restored after each."""
    import os

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import served

    seen: list[tuple[str, str | None]] = []
    monkeypatch.setattr(served.OursIds, "start", lambda self, budget, sizing: seen.append(
        ("start", os.environ.get("MLX_INFER_X"))))
    monkeypatch.setattr(served.OursIds, "run", lambda self, streams, prompts, gen: seen.append(
        ("run", os.environ.get("MLX_INFER_X"))) or 0)
    monkeypatch.setenv("MLX_INFER_X", "outer")
    column = object.__new__(served.env_column("MLX_INFER_X=7"))  # no model: __init__ loads one
    column.start(None, "test")
    assert os.environ["MLX_INFER_X"] == "outer"
    column.run(1, [[1]], 1)
    assert seen == [("start", "7"), ("run", "7")] and os.environ["MLX_INFER_X"] == "outer"


def test_served_benchmark_default_sizing_splits_the_device_between_in_process_engines(tmp_path):
    """No --memory-budget and two in-process mlx-infer columns: every model is loaded first, then
    each engine gets an equal explicit share of the default sizing (recorded in its rows)."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "served.py"
    out = tmp_path / "served.json"
    r = subprocess.run([sys.executable, str(script), "--shape", "gemma3-270m", "--toy", "--streams", "1",
                        "-p", "8", "-g", "2", "-r", "1", "-n", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["mlx-infer", "mlx-infer-ids", "mlx-lm"]
    for name in ("mlx-infer", "mlx-infer-ids"):
        assert rows[name]["kv_sizing"].startswith("1/2 of the default device sizing each")
        assert rows[name]["kv_pool_tokens"] > 0
    assert "kv_sizing" not in rows["mlx-lm"]


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_server_loop_benchmark_reports_the_loops_cpu_per_chunk(tmp_path, engine_process):
    """benchmarks/server_loop.py: the event loop's thread CPU per streamed chunk and the TTFT split, in its JSON."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "server_loop.py"
    out = tmp_path / "loop.json"
    r = subprocess.run([sys.executable, str(script), "--streams", "2", "--requests", "4", "-g", "4", "--rounds", "2",
                        "--json", str(out), *(["--engine-process"] if engine_process else [])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert all((row["engine_us_per_token"] is None) == engine_process for row in doc["rows"])
    assert [row["tokens"] for row in doc["rows"]] == [16, 16]  # 4 requests of 4 tokens a round
    assert all(0 < row["chunks"] <= 16 and row["loop_us_per_chunk"] > 0 for row in doc["rows"])
    assert doc["median_loop_us_per_chunk"] > 0 and "median loop CPU" in r.stdout
    for row in doc["rows"]:  # the TTFT split: its parts add up to the mean TTFT
        parts = row["send_to_app_mean_ms"] + row["app_to_first_bytes_mean_ms"] + row["first_bytes_to_client_mean_ms"]
        assert abs(parts - row["ttft_mean_ms"]) < 1e-6 * max(1.0, row["ttft_mean_ms"])
        assert 0 < row["engine_ttft_mean_ms"] <= row["ttft_mean_ms"]


def test_gpu_decode_benchmark_runs_the_moe_shapes_at_toy_sizes(tmp_path):
    """gpu_decode.py --tiny (float32 on the CPU, where MLX's gather_mm takes nothing else): gpt-oss's and
    Qwen3-MoE's shapes through mlx-lm and the compiled step, every row with a positive decode rate."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_decode.py"
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, str(script), "--tiny", "--models", "gpt-oss-20b-12l,qwen3-moe-a3b-24l",
                        "--batches", "1,2", "--engines", "mlx-lm,step", "-n", "1", "-p", "8", "-g", "4",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    got = sorted((row["model"], row["batch"], row["engine"]) for row in rows)
    assert got == sorted((m + "-tiny", b, e) for m in ("gpt-oss-20b-12l", "qwen3-moe-a3b-24l") for b in (1, 2)
                         for e in ("mlx-lm", "step"))
    assert all(row["decode_tps"] > 0 for row in rows), rows


def test_profile_tree_folds_py_spy_stacks_per_process(tmp_path):
    """benchmarks/profile_tree.py: a child's stacks (nested under its parent's by py-spy) count for the child."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_tree.py"
    spec = importlib.util.spec_from_file_location("profile_tree", path)
    profile_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_tree)

    raw = tmp_path / "raw.txt"
    raw.write_text(
        'process 1:"python served.py";<module> (served.py:9);run (served.py:5) 7\n'
        'process 1:"python served.py";process 2:"python -m mlx_infer serve";loop (app.py:3);send (http.py:8) 4\n'
        'process 1:"python served.py";process 2:"python -m mlx_infer serve";loop (app.py:3) 2\n')
    procs = profile_tree.fold(raw)
    parent, child = procs['process 1:"python served.py"'], procs['process 2:"python -m mlx_infer serve"']
    assert parent["samples"]["all"] == 7 and child["samples"]["all"] == 6
    assert child["self"]["send (http.py:8)"] == 4 and child["self"]["loop (app.py:3)"] == 2
    assert child["inclusive"]["loop (app.py:3)"] == 6 and "loop (app.py:3)" not in parent["inclusive"]


def test_kernel_times_folds_nsight_compute_csv_per_kind_and_step(tmp_path, capsys):
    """benchmarks/kernel_times.py's summarize mode: ncu's CSV (its ==PROF== lines skipped, gzipped or not, units
    and thousands separators read) folded into kinds per step, files side by side, the dearest kernels named."""
    import gzip
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_times.py"
    spec = importlib.util.spec_from_file_location("kernel_times", path)
    kernel_times = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_times)

    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [("void gemv_single<__nv_bfloat16, 8, 4>(const T1 *)", "usecond", "12.5"),
            ("void gemv_single<__nv_bfloat16, 8, 4>(const T1 *)", "nsecond", "7,500"),
            ("custom_kernel_mlxi_paged_attn_split_bfloat16_t(const float *)", "usecond", "3"),
            ("void scatter<__nv_bfloat16, int, ScatterAssign, 3, 1, int>(const T1 *)", "usecond", "2"),
            ("void CV2ISigmoidADV2IMultiplyACEV2OMultiplyDB_VV_contiguous<unsigned int, 8>()", "usecond", "1"),
            ("some_new_kernel(int)", "usecond", "4")]
    text = "==PROF== Connected to process 1\n" + head + "".join(
        f'"{i}","{n}","gpu__time_duration.sum","{u}","{v}"\n' for i, (n, u, v) in enumerate(rows))
    plain, packed = tmp_path / "a.csv", tmp_path / "b.csv.gz"
    plain.write_text(text)
    with gzip.open(packed, "wt") as f:
        f.write(text)
    got = kernel_times.summarize(plain, steps=2)
    assert got["gemv (MLX)"] == (1.0, 10.0) and got["attention"] == (0.5, 1.5)
    assert got["scatter / kv write"] == (0.5, 1.0) and got["fused silu * up (compiled)"] == (0.5, 0.5)
    assert got["other: some_new_kernel"] == (0.5, 2.0)
    assert kernel_times.summarize(packed, steps=2) == got
    kernel_times.print_summaries([plain, packed], steps=2)
    out = capsys.readouterr().out
    assert "total" in out and "the 15 dearest kernels" in out and "gemv_single" in out


def test_products_probe_times_ours_beside_mlx_and_reports_the_worst_ratio(tmp_path):
    """benchmarks/products.py (issue 17's probe): per-product rows for MLX and ours (the decode graphs' product: on
    the CPU, MLX's own, so the two time the same work), the 4- and 8-bit affine products with their packed bytes,
    step totals for each, and the worst-ratio report."""
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "products.py"
    out = tmp_path / "products.json"
    r = subprocess.run([sys.executable, str(script), "--tiny", "--ms", "1,8", "--shapes", "llama-1b", "--iters", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    per = {(x["engine"], x["m"], x["product"]) for x in rows if x["suite"] == "products"}
    for m in (1, 8):
        for product in ("q", "qkv", "o", "gate_up", "down", "head"):
            assert ("mlx", m, product) in per and ("ours", m, product) in per
            assert {("mlx-q4", m, product), ("mlx-q8", m, product), ("ours-q4", m, product)} <= per
    steps = {(x["engine"], x["m"]): x for x in rows if x["suite"] == "products-step"}
    assert {("mlx", 1), ("mlx-fused", 8), ("ours", 1), ("ours", 8), ("mlx-q4", 1), ("mlx-q8-fused", 8)} <= set(steps)
    # the quantized weights' bytes: 4 bits + a bf16 scale and bias per 64 = 0.5625 bytes a weight against bf16's 2
    bf16, q4 = steps[("mlx", 1)]["weights_at_bandwidth_ms"], steps[("mlx-q4", 1)]["weights_at_bandwidth_ms"]
    assert q4 == pytest.approx(bf16 * 0.5625 / 2)
    q = next(x for x in rows if (x["suite"], x["engine"], x["m"], x["product"]) == ("products", "mlx-q8", 1, "q"))
    assert q["tb_s"] * q["ms"] * 1e9 == pytest.approx(q["out"] * q["in"] * (1 + 4 / 64) + (q["in"] + q["out"]) * 2)

    sys.path.insert(0, str(script.parent))
    from products import worst_ratio

    fake = [{"suite": "products", "shape": "s", "m": m, "product": p, "engine": e, "ms": ms}
            for m, p, e, ms in [(1, "q", "cublas", 1.0), (1, "q", "ours", 1.5), (8, "o", "cublas", 2.0),
                                (8, "o", "ours", 5.0), (8, "o", "mlx", 3.0)]]
    assert worst_ratio(fake, "ours") == ("s", 8, "o", 2.5) and worst_ratio(fake, "mlx") == ("s", 8, "o", 1.5)
    assert worst_ratio([x for x in fake if x["engine"] != "cublas"], "ours") is None


def test_quantized_kernels_summary_labels_each_launch(tmp_path, capsys):
    """benchmarks/quantized_kernels.py --summarize: an ncu CSV's launches with the run's labels, TB/s of DRAM read;
    unlabelled when the counts differ."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from quantized_kernels import summarize

    head = '"ID","Kernel Name","Metric Name","Metric Value"\n'
    body = "".join(f'"{i}","k{i}(int)","{m}","{v}"\n' for i, (a, b) in enumerate([(2000, 9000000), (1000, 9000000)])
                   for m, v in (("gpu__time_duration.sum", f"{a:,}"), ("dram__bytes_read.sum", f"{b:,}")))
    (tmp_path / "q.csv").write_text("==PROF== noise\n" + head + body)
    (tmp_path / "l.txt").write_text("q 4-bit M=1 mlx\nq 4-bit M=1 ours\n")
    summarize(tmp_path / "q.csv", tmp_path / "l.txt")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2 kernels profiled for 2 products"
    assert out[1].startswith("q 4-bit M=1 mlx") and "2.0 us" in out[1] and "4.50 TB/s" in out[1] and "k0" in out[1]
    assert "9.00 TB/s" in out[2] and out[2].startswith("q 4-bit M=1 ours")
    (tmp_path / "l.txt").write_text("only one\n")
    summarize(tmp_path / "q.csv", tmp_path / "l.txt")
    assert capsys.readouterr().out.splitlines()[1].startswith("kernel 0")


def test_detokenizer_benchmark_reports_per_token_and_per_step_costs(tmp_path):
    """benchmarks/detokenizer.py: the detokenizer's microseconds a token on served.py's word tokenizer (and the
    real one where cached), and the engine's step with text against ids."""
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "detokenizer.py"
    out = tmp_path / "detok.json"
    r = subprocess.run([sys.executable, str(script), "--streams", "2", "--rounds", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    word = next(x for x in doc["per_token"] if x["tokenizer"] == "word-128k")
    assert word["random_us_per_token"] > 0 and word["readme_tokens"] > 1000
    (step,) = doc["engine_step"]
    assert step["streams"] == 2 and step["ids_step_ms"] > 0 and step["text_step_ms"] > 0


def test_host_step_interleaved_ab_steps_both_arms_alike(tmp_path):
    """benchmarks/host_step.py --ab --interleave: both arms' engines stepped in alternating blocks, each arm's
    median over every step of its blocks, and the per-block ratio; --ab repeated runs one A/B each over the one
    loaded model, and a switch may set several variables; --prompt sets the prompts' length."""
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "host_step.py"
    both = "MLX_INFER_PREFETCH_PLAN=0,MLX_INFER_FUSED_GATED=1"
    r = subprocess.run([sys.executable, str(script), "--streams", "2", "--ab", "MLX_INFER_PREFETCH_PLAN=0",
                        "--ab", both, "--interleave", "3", "--rounds", "4", "--prompt", "40"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if "interleaved" in ln]
    assert len(lines) == 6, r.stdout
    for ln, arm in zip(lines, ("unset", "MLX_INFER_PREFETCH_PLAN=0", "ratio", "unset", both, "ratio")):
        assert arm in ln
    for ln in lines[:2] + lines[3:5]:
        assert "(host" in ln and ln.endswith("; 12 steps)")  # 4 blocks of 3 steps each
    assert all("ratio per block: median" in ln and "4 blocks of 3 steps" in ln for ln in (lines[2], lines[5]))


def test_l2_prefetch_probe_pairs_each_product_with_its_stand_in_and_refuses_without_cuda():
    """benchmarks/gpu_l2_prefetch_probe.py: device durations in launch order become one (stand-in, product) pair
    per iteration (kernels before the first stand-in dropped, a product's kernels summed); off MLX's CUDA backend
    it exits with a message saying what it needs."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_l2_prefetch_probe.py"
    spec = importlib.util.spec_from_file_location("gpu_l2_prefetch_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    wait = "mlx::core::cu::custom_kernel_mlxi_probe_wait_1000_1_2048(const __nv_bfloat16 *)"
    events = [("gemv_single<__nv_bfloat16, 8, 4>", 9.0), (wait, 10.0), ("gemv_single<__nv_bfloat16, 8, 4>", 14.0),
              (wait, 11.0), ("gemv_single<__nv_bfloat16, 8, 4>", 6.0), ("splitk_reduce", 1.5)]
    events.insert(3, ("mlx::core::cu::custom_kernel_mlxi_l2_prefetch_262144_6144(const float *)", 2.0))
    assert probe.per_iteration(events) == {"wait": [10.0, 11.0], "product": [14.0, 7.5], "prefetch": [2.0]}
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:  # on a GPU machine the probe runs (benchmarks/RESULTS.md)
        r = subprocess.run([sys.executable, str(path), "--weights", "1b-o", "--spin-us", "1"], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode != 0 and "needs both on a GPU machine" in r.stderr, r.stderr[-2000:]
