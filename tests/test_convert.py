"""write_mlx_dir / convert on tiny inputs: output equal to mlx-lm's own convert, loadable by
mlx-lm, atomic, and never overwriting by accident.

Tolerances: our quantized tensors are bit-identical to mlx-lm's ``convert`` of the same HF
directory (same ``mx.quantize`` on the same float32 weights); dense weights round-trip exactly.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.artifacts.convert import convert, write_mlx_dir
from mlx_infer.errors import MlxInferError, ModelLoadError

CORPUS = ["The capital of France is Paris.", "def f(x):\n    return x + 1\n", "Hello world! 🙂 café"] * 8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama saved by transformers (safetensors), with a byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("hf_llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _load_dir(path):
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def test_dense_round_trip_copies_tokenizer(hf_dir, tmp_path):
    out = convert(hf_dir, tmp_path / "dense", progress=False)
    src, dst = _load_dir(hf_dir), _load_dir(out)
    assert set(src) == set(dst)
    for k in src:
        np.testing.assert_array_equal(np.array(dst[k]), np.array(src[k]), err_msg=k)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization" not in cfg
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(dst) and set(index["weight_map"].values()) == {"model.safetensors"}


def test_dtype_cast(hf_dir, tmp_path):
    out = convert(hf_dir, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert {v.dtype for v in _load_dir(out).values()} == {mx.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_equals_mlx_lm_convert_and_loads(hf_dir, tmp_path, bits):
    import mlx_lm
    from mlx_lm.convert import convert as mlx_lm_convert

    ours = convert(hf_dir, tmp_path / "ours", quantize_bits=bits, group_size=64, progress=False)
    theirs = tmp_path / "theirs"
    mlx_lm_convert(str(hf_dir), str(theirs), quantize=True, q_bits=bits, q_group_size=64)

    a, b = _load_dir(ours), _load_dir(theirs)
    assert set(a) == set(b)
    assert any(k.endswith(".scales") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    ca = json.loads((ours / "config.json").read_text())
    cb = json.loads((theirs / "config.json").read_text())
    assert ca["quantization"] == cb["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    assert ca["quantization_config"] == cb["quantization_config"]

    model, tok = mlx_lm.load(str(ours))
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    assert type(model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    ref_model, _ = mlx_lm.load(str(theirs))
    ids = mx.array([tok.encode("The capital of France is")])
    np.testing.assert_array_equal(np.array(model(ids)), np.array(ref_model(ids)))


def test_sharded_output_loads(hf_dir, tmp_path):
    import mlx_lm

    weights = _load_dir(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    out = write_mlx_dir(config, weights, tmp_path / "sharded", tokenizer_json=(hf_dir / "tokenizer.json").read_text(),
                        tokenizer_config=json.loads((hf_dir / "tokenizer_config.json").read_text()),
                        max_shard_bytes=100_000, progress=False)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights) and set(index["weight_map"].values()) == set(shards)
    model, _ = mlx_lm.load(str(out))
    assert model is not None


def test_failure_midway_leaves_nothing(hf_dir, tmp_path, monkeypatch):
    weights = _load_dir(hf_dir)
    real_save = mx.save_safetensors
    calls = []

    def failing_save(path, arrays, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real_save(path, arrays, metadata=metadata)

    monkeypatch.setattr(mx, "save_safetensors", failing_save)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="simulated"):
        write_mlx_dir({"model_type": "llama"}, weights, out, max_shard_bytes=100_000, progress=False)
    assert len(calls) == 2
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind either


def test_refuses_to_overwrite(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(MlxInferError, match="not empty"):
        convert(hf_dir, out, progress=False)
    with pytest.raises(MlxInferError, match="not written by mlx-infer convert"):
        convert(hf_dir, out, overwrite=True, progress=False)  # --overwrite never deletes what we did not write
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    mine = convert(hf_dir, tmp_path / "mine", progress=False)
    assert (mine / ".mlx-infer-convert").is_file()
    before = (mine / "model.safetensors").read_bytes()
    convert(hf_dir, mine, overwrite=True, dtype="float16", progress=False)  # our own output: replaced
    assert (mine / "model.safetensors").read_bytes() != before and (mine / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # nothing left beside it
    (mine / "notes.md").write_text("mine, not the converter's")
    with pytest.raises(MlxInferError, match=r"did not write \(notes\.md\)"):
        convert(hf_dir, mine, overwrite=True, progress=False)
    assert (mine / "notes.md").read_text() == "mine, not the converter's"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert(hf_dir, empty, progress=False) == empty  # an empty directory is fine


@pytest.mark.parametrize("where", ["source", "parent", "grandparent"])
def test_never_overwrites_the_source_or_a_parent_of_it(hf_dir, tmp_path, where):
    import shutil

    from fs_snapshot import snapshot

    src = tmp_path / "models" / "hf"
    shutil.copytree(hf_dir, src)
    (tmp_path / "models" / "unrelated.txt").write_text("keep")
    out = {"source": src, "parent": src.parent, "grandparent": tmp_path}[where]
    before = snapshot(tmp_path)
    with pytest.raises(MlxInferError, match="destroy it"):
        convert(src, out, overwrite=True, progress=False)
    assert snapshot(tmp_path) == before


def test_a_killed_conversion_leaves_the_output_and_the_next_one_cleans_up(hf_dir, tmp_path, monkeypatch):
    import mlx_infer.artifacts.output_dir as od

    out = convert(hf_dir, tmp_path / "out", progress=False)
    monkeypatch.setattr(od, "_exchange", lambda a, b: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert(hf_dir, out, overwrite=True, dtype="float16", progress=False)
    assert (out / "config.json").is_file()  # the old output is intact
    # a SIGKILL would have skipped the cleanup: leave a marked temp directory as it would
    stale = tmp_path / ".out.tmp-0123abcd"
    stale.mkdir()
    (stale / ".mlx-infer-convert").write_text(od.MARKER_TEXT)
    (stale / "config.json").write_text("{}")
    foreign = tmp_path / ".out.tmp-89abcdef"
    foreign.mkdir()
    (foreign / "thesis.txt").write_text("not ours")
    monkeypatch.undo()
    convert(hf_dir, out, overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-89abcdef", "out"]
    assert (foreign / "thesis.txt").read_text() == "not ours"


def test_exchange_is_atomic_here(tmp_path):
    from mlx_infer.artifacts.output_dir import _exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("b")
    assert _exchange(tmp_path / "a", tmp_path / "b")  # Linux tmpfs/ext4 and macOS APFS support it
    assert (tmp_path / "a" / "x").read_text() == "b" and (tmp_path / "b" / "x").read_text() == "a"


def test_bad_arguments_and_sources(hf_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        convert(tmp_path / "missing", tmp_path / "o1", progress=False)
    (tmp_path / "nosafetensors").mkdir()
    (tmp_path / "nosafetensors" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="safetensors"):
        convert(tmp_path / "nosafetensors", tmp_path / "o2", progress=False)
    with pytest.raises(MlxInferError, match="quantize_bits"):
        convert(hf_dir, tmp_path / "o3", quantize_bits=7, progress=False)
    with pytest.raises(MlxInferError, match="group_size"):
        convert(hf_dir, tmp_path / "o4", quantize_bits=4, group_size=48, progress=False)
    q = convert(hf_dir, tmp_path / "q", quantize_bits=4, progress=False)
    with pytest.raises(MlxInferError, match="already quantized"):
        convert(q, tmp_path / "o5", quantize_bits=4, progress=False)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def test_only_the_checkpoint_shards_are_read(hf_dir, tmp_path):
    """A second copy of the weights under another name (consolidated.safetensors) is not merged in."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    mx.save_safetensors(str(src / "consolidated.safetensors"), {"tok_embeddings.weight": mx.zeros((4, 4))})
    out = convert(src, tmp_path / "out", progress=False)
    assert "tok_embeddings.weight" not in _load_dir(out)
