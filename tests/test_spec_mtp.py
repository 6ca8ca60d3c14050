"""DeepSeek-V4's MTP drafter on a tiny random checkpoint with random `mtp.0.*` tensors (transformers saves
none): its drafts and confidences after every engine step equal a cache-free reference built from
transformers' own modules, greedy speculation with it is lossless, and it is refused where it cannot run."""
import pytest
import torch
from safetensors.torch import load_file

from deepinfer import LLM, SamplingParams, _C
from deepinfer.models.deepseek_v4 import mtp_checkpoint_tensors
from deepinfer.spec_decode import speculator
from test_deepseek_v4 import SWA, _rewrite_checkpoint, hf_greedy, make_checkpoint, prompt_of, randomize_, tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")


def mtp_reference_module(seed):
    """A one-layer transformers DeepseekV4 model whose only layer, HyperHead and final norm are the MTP
    block, head and head norm (MTP's block is sliding-window and top-k routed), plus e/h projections."""
    from transformers import DeepseekV4ForCausalLM as HF

    torch.manual_seed(seed)
    ref = HF(tiny_config(num_hidden_layers=1, layer_types=[SWA], mlp_layer_types=["moe"])).float().eval()
    randomize_(ref, seed)
    g = torch.Generator().manual_seed(seed + 1)
    H = ref.config.hidden_size
    extra = {"enorm.weight": 1 + 0.2 * torch.randn(H, generator=g), "hnorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
             "e_proj.weight": torch.randn(H, H, generator=g) * H ** -0.5,
             "h_proj.weight": torch.randn(H, H, generator=g) * H ** -0.5}
    return ref, extra


def mtp_tensors(ref_dir, extra):
    """The reference module's checkpoint renamed into DeepSeek's `mtp.0.*` layout."""
    return mtp_checkpoint_tensors(load_file(str(ref_dir / "model.safetensors")), extra)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4mtp")
    hf = make_checkpoint(root / "base", seed=3)
    ref, extra = mtp_reference_module(seed=4)
    ref.save_pretrained(root / "ref")
    path = _rewrite_checkpoint(root / "base", root / "tiny", lambda t: {**t, **mtp_tensors(root / "ref", extra)})
    return str(path), hf, ref, extra


class Reference:
    """Cache-free drafts: the target's pre-HyperHead streams from transformers over the settled tokens,
    MTP rows through the one-layer reference model with its layer input replaced by the MTP's mix."""

    def __init__(self, hf, ref, extra):
        self.hf, self.ref, self.extra = hf, ref, extra
        self.eps = hf.config.rms_norm_eps

    def _norm(self, x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))

    def _mix(self, streams, next_ids, positions):
        e = self.hf.model.embed_tokens(next_ids).masked_fill((positions == 0)[:, None], 0)
        h = self._norm(streams, self.extra["hnorm.weight"]) @ self.extra["h_proj.weight"].t()
        return h + (self._norm(e, self.extra["enorm.weight"]) @ self.extra["e_proj.weight"].t()).unsqueeze(1)

    def _mtp(self, inputs):
        """inputs [T, N, H] mixed rows at positions 0..T-1 -> (output streams [T, N, H], logits [T, V])."""
        captured = {}
        layer = self.ref.model.layers[0]
        pre = layer.register_forward_pre_hook(lambda m, args: (inputs[None],) + args[1:])
        post = layer.register_forward_hook(lambda m, args, out: captured.setdefault("s", out))
        try:
            hidden = self.ref.model(inputs_embeds=torch.zeros(1, inputs.shape[0], inputs.shape[-1])).last_hidden_state
        finally:
            pre.remove()
            post.remove()
        return captured["s"][0], self.hf.lm_head(hidden[0]).float()

    @torch.no_grad()
    def drafts(self, tokens, k):
        """tokens: every token of the sequence so far (its last one not yet run through the target)."""
        captured = {}
        hook = self.hf.model.hc_head.register_forward_hook(lambda m, args, out: captured.setdefault("s", args[0]))
        try:
            self.hf(torch.tensor([tokens[:-1]]))
        finally:
            hook.remove()
        streams, ids = captured["s"][0], torch.tensor(tokens[1:])
        inputs = self._mix(streams, ids, torch.arange(len(ids)))
        out_tokens, conf = [], []
        for j in range(k):
            out, logits = self._mtp(inputs)
            d = int(logits[-1].argmax())
            out_tokens.append(d)
            conf.append(float(logits[-1].softmax(-1)[d]))
            pos = torch.tensor([inputs.shape[0]])
            inputs = torch.cat([inputs, self._mix(out[-1:], torch.tensor([d]), pos)])
        return out_tokens, conf


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunks-of-5"])
def test_mtp_drafts_match_a_cache_free_reference(ckpt, chunk):
    """Also with the prompts prefilled in chunks: every chunk's rows reach the MTP ring."""
    path, hf, ref, extra = ckpt
    k = 3
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=chunk,
              speculative={"method": "mtp", "num_draft_tokens": k, "verify": "all"})
    engine, reference = llm.engine, Reference(hf, ref, extra)
    prompts = [prompt_of(13, 40), prompt_of(6, 41)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        drafter = engine.spec.drafter
        for seq_id in engine.scheduler.running_ids():
            seq = engine.scheduler.sequence(seq_id)
            if seq.num_computed_tokens < seq.num_tokens - 1:
                continue  # a chunked prefill under way drafts nothing yet
            tokens = list(seq.token_ids)
            want_tokens, want_conf = reference.drafts(tokens, k)
            got_tokens, got_conf, _ = drafter.drafts[seq_id]
            assert got_tokens.tolist() == want_tokens, f"step with {len(tokens)} tokens"
            torch.testing.assert_close(got_conf, torch.tensor(want_conf, dtype=torch.float64), rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked >= 8  # positions well past the sliding window (8): the MTP ring is read and reused


@pytest.mark.parametrize("k, verify, calibrate", [(2, "all", False), (4, "greedy", True)])
def test_greedy_mtp_speculation_is_lossless(ckpt, k, verify, calibrate, monkeypatch):
    """The step-time curve is a fixed gentle slope, as in test_spec_v4: "greedy" verifies a draft only where the
    curve says it pays, and this tiny model's measured curve (~10 ms steps) is noise on a shared 2-vCPU box (2 query
    rows measured 1.0-1.4x one row's time, and once verified none). The greedy against a curve is tested in
    test_spec.py; here drafts must be verified."""
    monkeypatch.setattr(speculator, "step_time_curve",
                        lambda engine, k: _C.StepTimeCurve([1.0, 64.0], [1.0, 1.63]))
    path, hf, _, _ = ckpt
    prompts = [prompt_of(5, 50), prompt_of(21, 51), prompt_of(40, 52)]
    refs = [hf_greedy(hf, p, 20) for p in prompts]
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4, num_threads=1,
              speculative={"method": "mtp", "num_draft_tokens": k, "verify": verify, "calibrate": calibrate})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    assert sum(o.metrics.spec_verified_drafts for o in outs) > 0


def test_calibration_fits_the_temperature_that_explains_acceptance():
    from deepinfer.spec_decode.mtp import CALIB_TOP_K, fit_temperature

    g = torch.Generator().manual_seed(0)
    true_t = 2.0
    samples = []
    for _ in range(3000):
        gaps = torch.sort(torch.rand(CALIB_TOP_K, generator=g) * 6).values
        gaps[0] = 0
        p = float(1 / torch.exp(-gaps / true_t).sum())
        samples.append((gaps, bool(torch.rand((), generator=g) < p)))
    assert abs(float(fit_temperature(samples)) - true_t) < 0.35
    assert float(fit_temperature([])) == 1.0


def test_mtp_tensors_load_into_the_mtp_layer(ckpt):
    from deepinfer.models.loader import load_model

    path, _, ref, extra = ckpt
    model, _ = load_model(path, torch.float32)
    mtp = model.mtp[0]
    torch.testing.assert_close(mtp.e_proj.weight, extra["e_proj.weight"])
    torch.testing.assert_close(mtp.head_norm.weight, ref.model.norm.weight)
    torch.testing.assert_close(mtp.block.self_attn.sinks, ref.model.layers[0].self_attn.sinks)
    experts = ref.model.layers[0].mlp.experts
    torch.testing.assert_close(mtp.block.mlp.experts.down_proj, experts.down_proj)


def test_mtp_is_refused_without_mtp_weights(tmp_path):
    make_checkpoint(tmp_path / "plain", seed=5)
    with pytest.raises(ValueError, match="no MTP layers"):
        LLM(str(tmp_path / "plain"), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=2,
            speculative={"method": "mtp", "num_draft_tokens": 2})


def test_missing_mtp_tensor_is_named(ckpt, tmp_path):
    from pathlib import Path

    path = Path(ckpt[0])
    broken = _rewrite_checkpoint(path, tmp_path / "broken",
                                 lambda t: {n: v for n, v in t.items() if n != "mtp.0.e_proj.weight"})
    with pytest.raises(ValueError, match="e_proj"):
        LLM(str(broken), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=2)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_seeded_sampling_with_mtp_equals_plain_sampling(ckpt, k):
    """Sampled tokens are the Gumbel-max draws of (seed, position): MTP drafts change none of them, in the
    first generate and after the calibration has adapted to earlier requests (the second)."""
    path, _, _, _ = ckpt
    prompts = [prompt_of(5, 50), prompt_of(21, 51), prompt_of(40, 52)]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=16, ignore_eos=True) for t, s in ((0.8, 1), (1.2, 2), (0.5, 3))]
    plain = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4, num_threads=1)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4, num_threads=1,
              speculative={"method": "mtp", "num_draft_tokens": k, "verify": "all", "calibrate": True})
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert sum(o.metrics.spec_verified_drafts for o in outs) > 0
