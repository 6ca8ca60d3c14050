"""Trains the embedded default model: a ~12M-parameter DeepSeek-V4 (sliding, CSA and HCA attention, a
hash-routed and three top-k routed MoE layers with a shared expert, 4 hyper-connection streams, one MTP
layer) on the Python standard library's own source, with a byte-level BPE tokenizer trained by `tokenizers`.

    .venv/bin/python scripts/train_tiny_moe.py            # ~70 min on 2 cores; writes deepinfer/assets/tiny-moe

Reproducible: the corpus is this interpreter's stdlib (files listed in sorted order, tests excluded), the
held-out split is fixed by a CRC of each file's path, and every random choice comes from --seed. CI never
trains. The main model is transformers' DeepseekV4ForCausalLM; the MTP layer is built from transformers'
modules exactly as the engine runs it (deepinfer/models/deepseek_v4.py, MTPLayer): row t mixes the main
model's pre-HyperHead streams at t with the embedding of token t+1 (zeroed at position 0) and predicts t+2.
Expert load is balanced without an auxiliary loss, as DeepSeek-V3 does: after each step every routed layer's
correction bias moves by --bias-rate against its experts' load. The report (loss curve, held-out
perplexity, MTP accuracy, expert load) goes to docs/tiny_moe.md.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from deepinfer.default_model import corpus_files, is_held_out, read_source  # noqa: E402
from deepinfer.models.deepseek_v4 import mtp_checkpoint_tensors  # noqa: E402

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]


def model_config(vocab_size: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, head_dim=64, q_lora_rank=128, partial_rotary_factor=0.5,
        num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, o_groups=2, o_lora_rank=128,
        index_n_heads=4, index_head_dim=32, index_topk=16, sliding_window=64,
        layer_types=[SWA, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 32},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=4, max_position_embeddings=2048,
        num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="bfloat16",
        architectures=["DeepseekV4ForCausalLM"])


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # A prompt starts as a file does in training: after <|bos|>.
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    return tok


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """Every file as <|bos|> text <|eos|>, concatenated -> [n_tokens] int64."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [1]
    return torch.tensor(ids, dtype=torch.long)


class MTP(nn.Module):
    """The MTP layer as the engine's MTPLayer computes it, from transformers' modules: a one-layer
    DeepseekV4Model (sliding window, top-k MoE) whose layer input is replaced by the e/h mix, whose own
    HyperHead and final norm are the MTP head; embedding and lm_head are the main model's."""

    def __init__(self, cfg):
        super().__init__()
        from transformers import DeepseekV4Model
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

        H = cfg.hidden_size
        one = cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": 1, "layer_types": [SWA],
                               "mlp_layer_types": ["moe"]})
        self.body = DeepseekV4Model(one)
        self.body.embed_tokens = None  # inputs come from the mix; the main embedding is shared
        self.enorm, self.hnorm = DeepseekV4RMSNorm(H, cfg.rms_norm_eps), DeepseekV4RMSNorm(H, cfg.rms_norm_eps)
        self.e_proj, self.h_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self._mix = None
        self.body.layers[0].register_forward_pre_hook(lambda m, args: (self._mix,) + args[1:])

    def forward(self, streams, next_embeds):
        """streams [B, T, N, H] main pre-HyperHead streams at positions 0..T-1; next_embeds [B, T, H] the
        embedding of the token after each position -> hidden [B, T, H] for the shared lm_head."""
        next_embeds = torch.cat([torch.zeros_like(next_embeds[:, :1]), next_embeds[:, 1:]], 1)
        self._mix = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_embeds)).unsqueeze(2)
        try:
            return self.body(inputs_embeds=torch.zeros_like(next_embeds)).last_hidden_state
        finally:
            self._mix = None

    def checkpoint_tensors(self) -> dict:
        """DeepSeek's `mtp.0.*` names, as deepinfer's loader reads them."""
        own = {f"{k}.weight": getattr(self, k).weight for k in ("enorm", "hnorm", "e_proj", "h_proj")}
        return mtp_checkpoint_tensors(self.body.state_dict(), own)


class Trainer:
    def __init__(self, cfg, args):
        from transformers import DeepseekV4ForCausalLM

        self.args = args
        torch.manual_seed(args.seed)
        self.main = DeepseekV4ForCausalLM(cfg)
        self.mtp = MTP(cfg)
        self._fix_hash_tables(cfg)
        self.streams = None
        self.main.model.hc_head.register_forward_hook(lambda m, a, out: setattr(self, "streams", a[0]))
        self.load = {}
        for name, mod in self.named_routers():
            mod.register_forward_hook(self._count(name, cfg.n_routed_experts))
        params = [p for p in list(self.main.parameters()) + list(self.mtp.parameters()) if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=args.lr, betas=(0.9, 0.95))

    def _fix_hash_tables(self, cfg):
        """A frozen random token -> experts table for each hash-routed layer (zeros would send every token
        to the same experts)."""
        g = torch.Generator().manual_seed(self.args.seed + 1)
        for m in self.main.modules():
            if hasattr(m, "tid2eid"):
                m.tid2eid.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                             for _ in range(cfg.vocab_size)]))

    def named_routers(self):
        for prefix, root in (("", self.main), ("mtp.", self.mtp)):
            for name, m in root.named_modules():
                if hasattr(m, "e_score_correction_bias"):
                    yield prefix + name, m

    def _count(self, name, n_experts):
        def hook(mod, args, out):
            c = torch.bincount(out[2].flatten(), minlength=n_experts).double()
            self.load[name] = self.load.get(name, 0) + c
        return hook

    def losses(self, x):
        """x [B, T] -> (main next-token loss, MTP next-next-token loss)."""
        logits = self.main(input_ids=x).logits
        main = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        hidden = self.mtp(self.streams[:, :-2], self.main.model.embed_tokens(x[:, 1:-1]))
        mtp_logits = self.main.lm_head(hidden)
        return main, F.cross_entropy(mtp_logits.flatten(0, 1), x[:, 2:].flatten())

    def lr_at(self, step):
        a = self.args
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        frac = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))

    def step(self, step, x):
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)
        self.load = {}
        main, mtp = self.losses(x)
        (main + self.args.mtp_weight * mtp).backward()
        torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._balance()
        return float(main), float(mtp)

    @torch.no_grad()
    def _balance(self):
        """Aux-loss-free balancing: overloaded experts' bias down, underloaded up."""
        for name, mod in self.named_routers():
            c = self.load.get(name)
            if c is not None:
                mod.e_score_correction_bias.add_(self.args.bias_rate * torch.sign(c.mean() - c).float())

    @torch.no_grad()
    def evaluate(self, windows):
        """windows [W, T] -> (main loss, MTP loss, MTP top-1 accuracy, per-router load [E] summed)."""
        self.main.eval(), self.mtp.eval()
        self.load = {}
        tot_main = tot_mtp = correct = n_main = n = 0.0
        for x in windows.split(8):
            logits = self.main(input_ids=x).logits
            tot_main += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
            n_main += x[:, 1:].numel()
            mtp_logits = self.main.lm_head(self.mtp(self.streams[:, :-2], self.main.model.embed_tokens(x[:, 1:-1])))
            tot_mtp += float(F.cross_entropy(mtp_logits.flatten(0, 1), x[:, 2:].flatten(), reduction="sum"))
            correct += float((mtp_logits.argmax(-1) == x[:, 2:]).sum())
            n += x[:, 2:].numel()
        self.main.train(), self.mtp.train()
        return tot_main / n_main, tot_mtp / n, correct / n, dict(self.load)

    def save(self, out_dir, cfg, tok):
        """bf16 safetensors (routing tables and correction biases kept exact), config and tokenizer."""
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        tensors = {**self.main.state_dict(), **self.mtp.checkpoint_tensors()}
        save_file({k: _stored(k, v) for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        cfg.save_pretrained(out_dir)
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
                       "eos_token": SPECIALS[1], "pad_token": SPECIALS[2], "model_max_length": 2048,
                       "clean_up_tokenization_spaces": False}, f, indent=2)


def _stored(name: str, t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if not t.is_floating_point() or name.endswith("e_score_correction_bias"):
        return t
    return t.to(torch.bfloat16)


def windows_from(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` evenly spaced windows of `length` tokens -> [count, length]."""
    starts = torch.linspace(0, len(stream) - length - 1, count).long()
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def imbalance(load: torch.Tensor) -> float:
    """max / mean expert load: 1.0 is perfectly balanced."""
    return float(load.max() / load.mean())


def write_report(path, args, corpus, log, final, cfg, n_params):
    main_loss, mtp_loss, mtp_acc, load = final
    lines = [
        "# The embedded default model: a tiny DeepSeek-V4 trained on the Python standard library",
        "",
        f"Written by `scripts/train_tiny_moe.py` ({time.strftime('%Y-%m-%d')}). Command:",
        "",
        "```bash",
        f".venv/bin/python scripts/train_tiny_moe.py --steps {args.steps} --batch {args.batch} --seq-len {args.seq_len} "
        f"--lr {args.lr} --seed {args.seed} --threads {args.threads}",
        "```",
        "",
        f"- Corpus: {corpus['files']} `.py` files of Python {corpus['python']}'s standard library "
        f"(`{corpus['root']}`, tests, idlelib, lib2to3 and turtledemo excluded), {corpus['chars'] / 1e6:.1f}M "
        f"characters; {corpus['held_out_files']} files held out by CRC32(path) % 20 == 0.",
        f"- Tokenizer: byte-level BPE trained by `tokenizers` on the training files, vocab {cfg.vocab_size}; "
        f"{corpus['train_tokens'] / 1e6:.2f}M training tokens, {corpus['held_out_tokens'] / 1e6:.2f}M held-out.",
        f"- Model: DeepSeek-V4, hidden {cfg.hidden_size}, layers {cfg.layer_types} with MLPs {cfg.mlp_layer_types}, "
        f"{cfg.n_routed_experts} routed experts top-{cfg.num_experts_per_tok} + {cfg.n_shared_experts} shared, "
        f"hc_mult {cfg.hc_mult}, one MTP layer; {n_params / 1e6:.1f}M parameters (stored bf16).",
        f"- Training: {args.steps} steps of {args.batch} x {args.seq_len} tokens "
        f"({args.steps * args.batch * args.seq_len / 1e6:.1f}M tokens), AdamW lr {args.lr} (warm-up {args.warmup}, "
        f"cosine to 10%), MTP loss weight {args.mtp_weight}, bias balancing rate {args.bias_rate}; "
        f"{final_minutes(log):.0f} min on {args.threads} threads.",
        "",
        f"**Held-out perplexity {math.exp(main_loss):.2f}** (loss {main_loss:.3f} nats/token). MTP (predicting the "
        f"token after next): held-out loss {mtp_loss:.3f}, top-1 accuracy {mtp_acc:.3f}.",
        "",
        "| step | train loss | train MTP loss | held-out loss | held-out perplexity | minutes |",
        "|---|---|---|---|---|---|",
    ]
    for row in log:
        held = f"{row['val']:.3f} | {math.exp(row['val']):.1f}" if "val" in row else " | "
        lines.append(f"| {row['step']} | {row['train']:.3f} | {row['train_mtp']:.3f} | {held} | {row['minutes']:.1f} |")
    lines += ["", "Expert load on the held-out windows (max / mean per routed layer; 1.0 is balanced):", ""]
    lines += [f"- `{name}`: {imbalance(c):.2f} ({', '.join(str(int(v)) for v in c.tolist())})" for name, c in load.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def final_minutes(log) -> float:
    return log[-1]["minutes"] if log else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "deepinfer", "assets", "tiny-moe"))
    ap.add_argument("--report", default=os.path.join(ROOT, "docs", "tiny_moe.md"))
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    root, files = corpus_files()
    train_files = [f for f in files if not is_held_out(f)]
    held_files = [f for f in files if is_held_out(f)]
    train_texts, held_texts = [read_source(root, f) for f in train_files], [read_source(root, f) for f in held_files]
    tok = train_tokenizer(train_texts, args.vocab)
    train, held = token_stream(tok, train_texts), token_stream(tok, held_texts)
    corpus = {"root": root, "python": ".".join(map(str, sys.version_info[:3])), "files": len(files),
              "held_out_files": len(held_files), "chars": sum(map(len, train_texts + held_texts)),
              "train_tokens": len(train), "held_out_tokens": len(held)}
    print(json.dumps(corpus), flush=True)

    cfg = model_config(tok.get_vocab_size())
    trainer = Trainer(cfg, args)
    n_params = sum(p.numel() for p in trainer.main.parameters()) + sum(
        t.numel() for t in trainer.mtp.checkpoint_tensors().values())
    val = windows_from(held, 64, args.seq_len)
    g = torch.Generator().manual_seed(args.seed + 2)
    log, t0 = [], time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq_len, (args.batch,), generator=g)
        x = torch.stack([train[s:s + args.seq_len] for s in starts.tolist()])
        main_loss, mtp_loss = trainer.step(step, x)
        row = {"step": step + 1, "train": main_loss, "train_mtp": mtp_loss, "minutes": (time.time() - t0) / 60}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            row["val"] = trainer.evaluate(val)[0]
            trainer.save(args.out, cfg, tok)
            log.append(row)
        elif (step + 1) % 50 == 0:
            log.append(row)
        if (step + 1) % 10 == 0:
            print(json.dumps(row), flush=True)
    final = trainer.evaluate(val)
    write_report(args.report, args, corpus, log, final, cfg, n_params)
    print(f"held-out perplexity {math.exp(final[0]):.2f}, MTP top-1 {final[2]:.3f}; wrote {args.out} and {args.report}")


if __name__ == "__main__":
    main()
