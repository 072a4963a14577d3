"""The stateless data module and `scaleout prepare-data`."""

import numpy as np
import pytest
from conftest import losses, run_cell, summary

from launch import config
from launch.data.batches import Batches


def test_batch_is_a_function_of_seed_and_step_and_slices_agree():
    cfg = config.load()
    b = Batches(cfg.data, 256, 32)
    full = b.rows(5, 0, 8)
    assert np.array_equal(full, Batches(cfg.data, 256, 32).rows(5, 0, 8))  # a fresh instance: same tokens
    assert np.array_equal(np.concatenate([b.rows(5, 0, 3), b.rows(5, 3, 8)]), full)  # any split of rows
    assert not np.array_equal(b.rows(6, 0, 8), full)
    other = config.load(["data.seed=7"])
    assert not np.array_equal(Batches(other.data, 256, 32).rows(5, 0, 8), full)
    x, y = b.split(5, 0, 8)
    assert np.array_equal(x, full[:, :-1]) and np.array_equal(y, full[:, 1:]) and x.shape == (8, 32) and full.max() < 256


def test_file_batches_are_windows_of_the_memmapped_file(tmp_path):
    """Protects against: a file source that does not train on the file (synthetic tokens, a wrong dtype, a
    window past the end, the same offset for every row or step). Every token of the file is distinct, so
    each row must be exactly tokens[off : off + seq_len + 1] at a seeded offset, inputs the first
    seq_len of it and targets the same window shifted by one."""
    tokens = np.arange(3000, dtype=np.uint32) + 100
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    cfg = config.load(["data.source=file", f"data.path={path}", "data.dtype=uint32", "model.vocab_size=4096"])
    T = 32
    b = Batches(cfg.data, 4096, T)
    offsets = set()
    for step in (0, 1, 7):
        rows = b.rows(step, 0, 8)
        x, y = b.split(step, 0, 8)
        for r, row in enumerate(rows):
            off = int(row[0]) - 100
            assert 0 <= off and off + T + 1 <= tokens.size
            assert np.array_equal(row, tokens[off: off + T + 1]), (step, r)
            assert np.array_equal(x[r], tokens[off: off + T]) and np.array_equal(y[r], tokens[off + 1: off + T + 1])
            assert off == int(np.random.default_rng([cfg.data.seed, step, r]).integers(0, tokens.size - T - 1))
            offsets.add(off)
    assert len(offsets) == 24  # every row of every step its own window


def test_prepare_data_then_train_on_the_file(tmp_path, scaleout):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    code, out, err = scaleout("prepare-data", str(text), str(tmp_path / "tokens.bin"))
    assert code == 0, err
    tokens = np.fromfile(tmp_path / "tokens.bin", dtype=np.uint16)
    assert tokens.size == len(text.read_bytes()) and bytes(tokens[:9].astype(np.uint8)) == b"the quick"
    cfg = config.load(["data.source=file", f"data.path={tmp_path / 'tokens.bin'}"])
    x, y = Batches(cfg.data, 256, 32).split(0, 0, 4)
    text_bytes = text.read_bytes()
    for row_x, row_y in zip(x, y):  # every window is a stretch of the text, byte for byte
        window = bytes(row_x.astype(np.uint8)) + bytes(row_y[-1:].astype(np.uint8))
        assert window in text_bytes and bytes(row_y.astype(np.uint8)) == window[1:]
    code, _, err = scaleout("prepare-data", str(tmp_path / "missing.txt"), str(tmp_path / "x.bin"))
    assert code == 2 and "does not exist" in err


@pytest.mark.slow
def test_jax_trains_on_a_token_file(tmp_path, scaleout):
    """Protects against: a trainer that ignores data.source=file (a falling loss alone is also met by
    synthetic data). The first recorded loss is the initial weights' loss on batch 0; recomputed here
    from the file's batch 0 (framework-neutral init, reference forward) it must match, and differ from
    the loss on the synthetic batch 0."""
    import torch

    from launch.core.params import init_param, named_params
    from torchrun_fsdp.model import Transformer, cross_entropy

    text = tmp_path / "corpus.txt"
    text.write_text("abcabcabd " * 500)
    assert scaleout("prepare-data", str(text), str(tmp_path / "tokens.bin"))[0] == 0
    overrides = ["train.steps=2", "data.source=file", f"data.path={tmp_path / 'tokens.bin'}"]
    _, recs = run_cell(tmp_path, *overrides)
    assert summary(recs)["status"] == "ok"
    cfg = config.load(overrides)
    m = cfg.model
    model = Transformer(m)
    model.load_state_dict({n: torch.from_numpy(init_param(m, cfg.train.seed, n, s).copy()) for n, s in named_params(m)})

    def loss_on(data):
        x, y = Batches(data, m.vocab_size, m.seq_len).split(0, 0, cfg.train.global_batch)
        with torch.no_grad():
            return float(cross_entropy(model(torch.from_numpy(x.astype(np.int64))), torch.from_numpy(y.astype(np.int64))))

    on_file, on_synthetic = loss_on(cfg.data), loss_on(config.load().data)
    assert losses(recs)[1] == pytest.approx(on_file, rel=1e-5)
    assert abs(on_file - on_synthetic) > 1e-3 * on_file


def test_native_sharded_init_puts_a_quarter_on_each_device(tmp_path):
    import jax

    from jaxrun.mesh import path_name
    from jaxrun.train import JaxEngine
    from launch.launcher.rundir import cell_config

    cfg = cell_config(config.load(["devices=4", "model.init=native", f"checkpoint.dir={tmp_path}/c"]), "x")
    engine = JaxEngine(cfg, tmp_path)
    engine.init_state()
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.params)[0]:
        if "norm" not in path_name(path):
            assert all(s.data.size * 4 == leaf.size for s in leaf.addressable_shards), path_name(path)
    assert float(jax.numpy.std(engine.params["output"][...])) == pytest.approx(0.02, rel=0.2)


def test_prepare_bytes_writes_atomically_and_leaves_nothing_on_failure(tmp_path):
    from launch.data.batches import prepare_bytes
    text = tmp_path / "corpus.txt"
    text.write_text("hello")
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError):
        prepare_bytes(str(text), str(tmp_path / "out"))  # a directory where the file should go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"] and not list((tmp_path / "out").iterdir())
    assert prepare_bytes(str(text), str(tmp_path / "sub" / "t.bin")) == 5
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["t.bin"]
