"""bench/bench_host.py: the in/out split of the op counter, and the table and rows on a tiny setting."""
import json

import pytest
import torch

from tests.helpers import load_bench_script


def load():
    return load_bench_script("bench_host")


class Twice(torch.nn.Module):
    def forward(self, x):
        return (x + 1) * 2  # two aten ops inside


def test_probe_splits_ops_at_the_model_boundary():
    bh = load()
    model = Twice()
    probe = bh.Probe({"target": model})
    x = torch.ones(3)
    with bh.CountOps(probe):
        y = model(x)
        z = torch.add(y, x)  # one op outside
        model(z)
    probe.remove()
    assert probe.forwards == {"target": 2}
    assert probe.ops == {"target": 4, bh.OUTSIDE: 1}
    assert probe.where == bh.OUTSIDE
    model(x)  # hooks removed: nothing counted
    assert probe.forwards == {"target": 2}


class Outer(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_probe_refuses_a_forward_inside_another():
    bh = load()
    inner = Twice()
    outer = Outer(inner)
    probe = bh.Probe({"target": outer, "draft": inner})
    with pytest.raises(RuntimeError, match="a draft forward started inside a target forward"):
        outer(torch.ones(2))
    probe.remove()


def test_table_and_rows_on_the_bundled_pair(tmp_path, capsys):
    bh = load()
    out = tmp_path / "host.json"
    assert bh.main(["--prompts", "1", "--max-new-tokens", "8", "--repeats", "1", "--top", "3",
                    "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bench_host: bundled tiny pair, 1 prompts x 8 tokens, greedy" in text
    assert "vanilla: most frequent ops outside per target forward: " in text
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"vanilla", "paper", "exact"}
    for mode, r in rows.items():
        assert any(line.split()[:1] == [mode] for line in text.splitlines())
        assert r["new_tokens"] == 8 and r["num_hidden_layers"] == 4
        assert r["target_forwards"] > 0 and r["ops_outside"] > r["views_outside"] > 0
        assert r["ops_outside_per_target_forward"] == pytest.approx(r["ops_outside"] / r["target_forwards"])
        assert r["ops_in_target_per_layer"] == pytest.approx(r["ops_in_target_per_target_forward"] / 4)
        # the decoder layer modules hold most of a forward's ops, not all (embedding, norm, lm_head)
        assert 0 < r["ops_in_layer_modules_per_layer_call"] < r["ops_in_target_per_layer"] * 1.01
        assert r["cpu_ms_outside_per_target_forward"] > 0 and r["cpu_ms_in_target_per_target_forward"] > 0
        assert (r["draft_forwards"] > 0) == (mode != "vanilla")
        assert (r["ops_in_draft_per_draft_forward"] is None) == (mode == "vanilla")
        assert sum(r["top_ops_outside"].values()) == pytest.approx(r["ops_outside_per_target_forward"])
        assert sum(r["top_ops_in_target"].values()) == pytest.approx(r["ops_in_target_per_target_forward"])
    # the hooks count the forwards simsd's own counters report (decode forwards + the prefill)
    from simsd import DecodeConfig
    from simsd.decoding.vanilla import vanilla_generate_batch
    benchlib = bh.benchlib
    t, _ = benchlib.bundled_pair()
    prompts, _ = benchlib.prompt_ids(t.tokenizer, 1)
    stats = vanilla_generate_batch(t.model, prompts, DecodeConfig(max_new_tokens=8), t.mask_token_id,
                                   t.stop_ids).results[0].stats
    assert rows["vanilla"]["target_forwards"] == stats["target_forwards"] + stats["prefill_forwards"]


def test_sampling_row(tmp_path, capsys):
    bh = load()
    out = tmp_path / "host.json"
    assert bh.main(["--modes", "exact", "--temperature", "1.0", "--prompts", "1", "--max-new-tokens", "4",
                    "--repeats", "1", "--json", str(out)]) == 0
    assert "temperature 1.0" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mode"] == "exact" and row["temperature"] == 1.0 and row["draft_forwards"] > 0


def test_layer_counts(tmp_path, capsys):
    """``--layer``: one decoder layer's ops on real tensors (the torch door's SDPA counted op by
    op) and on fake tensors with the attention as the door's one op; the rows name every op."""
    bh = load()
    out = tmp_path / "layer.json"
    assert bh.main(["--layer", "--json", str(out)]) == 0
    assert "not views" in capsys.readouterr().out
    real, fake = json.loads(out.read_text())["rows"]
    assert (real["layer_count"], fake["layer_count"]) == ("real", "fake:cpu")
    for r in (real, fake):
        assert r["layer_ops"] == len(r["layer_op_list"]) == r["layer_views"] + r["layer_not_views"]
        assert r["layer_op_list"].count("aten::mm.default") == 4  # q/k/v, o, gate/up, down projections
    assert fake["layer_op_list"].count("simsd::attention_with_kvcache.default") == 1
    assert not [op for op in fake["layer_op_list"] if "scaled_dot_product" in op or op.startswith("aten::index_put_")]
    assert any("scaled_dot_product" in op for op in real["layer_op_list"])
