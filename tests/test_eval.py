"""Held-out evaluation (train.eval_every): the same loss on 1 and 2 devices and in both frameworks."""

import json

import pytest
from conftest import run_cli

from launch.core import metrics
from launch.data import corpus, tokenizer as tokenize


@pytest.mark.slow
def test_eval_loss_is_the_same_for_both_frameworks_and_device_counts(tmp_path):
    """At step 0 (initial weights) held-out loss agrees to 1e-5 relative in fp32 across jax/torch x 1/2
    devices; the report shows it, the summary has final_eval_loss."""
    docs = corpus.write(tmp_path / "corpus.jsonl", docs=400)
    tokenize.prepare([str(docs)], str(tmp_path / "data" / "tokens.bin"), "bpe", 512, 0.1)
    args = ["sweep", f"run.dir={tmp_path}/runs", "run.name=ev", f"checkpoint.dir={tmp_path}/ckpt",
            f"jax.cache_dir={tmp_path}/jaxcache", "sweep.frameworks=[jax,torch]", "sweep.devices=[1,2]",
            "sweep.scaling=strong", "train.steps=2", "train.eval_every=1", "train.eval_batches=2",
            "train.eval_batch_size=4", "train.global_batch=4", "data.source=file",
            f"data.path={tmp_path / 'data' / 'tokens.bin'}", "model.vocab_size=512", "metrics.tensorboard=true"]
    p = run_cli(args, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "runs" / "ev"
    evals, finals = {}, {}
    for cell in ("jax-d1", "jax-d2", "torch-d1", "torch-d2"):
        recs = metrics.read(run / cell / "metrics.jsonl")
        evals[cell] = {r["step"]: r["loss"] for r in recs if r["kind"] == "eval"}
        finals[cell] = [r for r in recs if r["kind"] == "summary"][-1]["final_eval_loss"]
        assert sorted(evals[cell]) == [0, 1, 2] and finals[cell] == evals[cell][2]
        assert list((run / cell / "tensorboard").iterdir())
    ref = evals["jax-d1"][0]
    assert 5.5 < ref < 7.0  # ~ln(512) at initialisation
    for cell, e in evals.items():
        assert abs(e[0] - ref) / ref < 1e-5, (cell, e[0], ref)
    for cell in ("jax-d2", "torch-d1", "torch-d2"):  # after training too (same data, same init): close
        assert abs(evals[cell][2] - evals["jax-d1"][2]) / evals["jax-d1"][2] < 1e-3, evals
    report = json.loads((run / "report.json").read_text())
    assert report["eval_loss_curves"]["torch-d2"][0][0] == 0
    assert "held-out loss" in (run / "report.md").read_text()
