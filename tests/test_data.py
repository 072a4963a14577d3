"""The stateless data module and `scaleout prepare-data`."""

import numpy as np
import pytest

from launch import config
from launch.data import Batches

from conftest import losses, run_cell, summary


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
    assert np.array_equal(x[:, 1:], y[:, :-1]) and x.shape == (8, 32) and full.max() < 256


def test_prepare_data_then_train_on_the_file(tmp_path, scaleout):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    code, out, err = scaleout("prepare-data", str(text), str(tmp_path / "tokens.bin"))
    assert code == 0, err
    tokens = np.fromfile(tmp_path / "tokens.bin", dtype=np.uint16)
    assert tokens.size == len(text.read_bytes()) and bytes(tokens[:9].astype(np.uint8)) == b"the quick"
    cfg = config.load(["data.source=file", f"data.path={tmp_path / 'tokens.bin'}"])
    x, y = Batches(cfg.data, 256, 32).split(0, 0, 4)
    assert np.array_equal(x[:, 1:], y[:, :-1])
    code, _, err = scaleout("prepare-data", str(tmp_path / "missing.txt"), str(tmp_path / "x.bin"))
    assert code == 2 and "does not exist" in err


@pytest.mark.slow
def test_jax_trains_on_a_token_file(tmp_path, scaleout):
    text = tmp_path / "corpus.txt"
    text.write_text("abcabcabd " * 500)
    assert scaleout("prepare-data", str(text), str(tmp_path / "tokens.bin"))[0] == 0
    _, recs = run_cell(tmp_path, "train.steps=15", "data.source=file", f"data.path={tmp_path / 'tokens.bin'}")
    c = losses(recs)
    assert summary(recs)["status"] == "ok" and c[15] < c[1] - 1.0


def test_native_sharded_init_puts_a_quarter_on_each_device(tmp_path):
    import jax
    from launch.rundir import cell_config
    from jaxrun.mesh import path_name
    from jaxrun.train import JaxEngine

    cfg = cell_config(config.load(["devices=4", "model.init=native", f"checkpoint.dir={tmp_path}/c"]), "x")
    engine = JaxEngine(cfg, tmp_path)
    engine.init_state()
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.params)[0]:
        if "norm" not in path_name(path):
            assert all(s.data.size * 4 == leaf.size for s in leaf.addressable_shards), path_name(path)
    assert float(jax.numpy.std(engine.params["output"][...])) == pytest.approx(0.02, rel=0.2)


def test_prepare_bytes_writes_atomically_and_leaves_nothing_on_failure(tmp_path):
    from launch.data import prepare_bytes
    text = tmp_path / "corpus.txt"
    text.write_text("hello")
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError):
        prepare_bytes(str(text), str(tmp_path / "out"))  # a directory where the file should go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"] and not list((tmp_path / "out").iterdir())
    assert prepare_bytes(str(text), str(tmp_path / "sub" / "t.bin")) == 5
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["t.bin"]
