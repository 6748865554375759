"""Train the embedded tiny code model on the Python standard library and export it as a GGUF.

    python scripts/train_tiny_model.py --out ane_spec/assets/tiny-code.Q8_0.gguf

The model has Phi-4-mini's exact architecture and GGUF schema (llama.cpp `phi3`), only small:
GQA, partial NEOX RoPE over 3/4 of each 64-dim head, LongRoPE factor tables with the attention
factor, tied embeddings, Q8_0 matrices. Its tokenizer is a byte-level BPE trained on the same
corpus (`build_trained_vocab`: gpt-4o split, Phi-4-mini's special tokens and layout).

The training forward pass is the reference forward's math (`ane_spec.model.reference`): the same
`rms_norm`, `apply_rope` and RoPE tables, fused qkv rows [Q|K|V], SwiGLU with gate rows first,
tied head. Training windows are <= 4096 tokens, the short factors' range (all 1.0), and the
attention factor multiplies cos and sin as it does at inference. After export the reference on
the written GGUF is compared with this model's logits (`verification` in the JSON).

Deterministic given `--seed` on a given machine and thread count: the batch of step s is a pure
function of (seed, s), so a run resumed from its checkpoint (`--work-dir`, written every
`--checkpoint-every` steps and at `--stop-after`) ends with the same bytes as an uninterrupted one.
Writes `OUT` and `OUT` with `.json` in place of `.gguf`: the exact command, corpus hash, steps,
wall time, final held-out loss, parameter count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from ane_spec.model.config import ModelConfig, longrope_attn_factor
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.gguf_writer import TensorSource, longrope_factor_tensors, write_gguf
from ane_spec.model.reference import ReferenceModel, apply_rope, rms_norm
from ane_spec.model.rope import make_rope_spec
from ane_spec.model.stdlib_corpus import corpus_sha256, split, stdlib_corpus
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.tokenizer_data import TokenizerData
from ane_spec.model.vocab import build_trained_vocab

HEAD_DIM = 64  # KV state rows of 64 are a multiple of 32, as the ANE shards need
CONTEXT_LENGTH, ORIGINAL_CONTEXT = 131072, 4096  # Phi-4-mini's: sets the attention factor


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        hidden_size=args.dim, num_layers=args.layers, num_heads=args.dim // HEAD_DIM,
        num_kv_heads=args.kv_heads, head_dim=HEAD_DIM, rope_dims=HEAD_DIM * 3 // 4,
        ffn_size=args.ffn, vocab_size=args.vocab_size, context_length=CONTEXT_LENGTH,
        original_context_length=ORIGINAL_CONTEXT,
        rope_attn_factor=longrope_attn_factor(CONTEXT_LENGTH, ORIGINAL_CONTEXT))


# -- the model ---------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        d = c.hidden_size
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.attn_qkv = nn.Parameter(torch.empty(c.qkv_rows, d))
        self.attn_output = nn.Parameter(torch.empty(d, d))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.ffn_up = nn.Parameter(torch.empty(2 * c.ffn_size, d))  # rows: gate, then up
        self.ffn_down = nn.Parameter(torch.empty(d, c.ffn_size))


class TinyPhi3(nn.Module):
    """llama.cpp's phi3 graph, batched `[B, T]`, parameters named and shaped as the GGUF's."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.token_embd = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.output_norm = nn.Parameter(torch.ones(c.hidden_size))

    def init_weights(self, generator: torch.Generator) -> None:
        std, layers = 0.02, self.config.num_layers
        with torch.no_grad():
            self.token_embd.normal_(0.0, std, generator=generator)
            for b in self.blocks:
                b.attn_qkv.normal_(0.0, std, generator=generator)
                b.ffn_up.normal_(0.0, std, generator=generator)
                # Residual-branch outputs scaled down with depth (GPT-2's rule).
                b.attn_output.normal_(0.0, std / math.sqrt(2 * layers), generator=generator)
                b.ffn_down.normal_(0.0, std / math.sqrt(2 * layers), generator=generator)

    def forward(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Logits `[B, T, vocab]`; cos/sin `[T, rope_dims/2]` already carry the attention factor."""
        c = self.config
        bsz, n = tokens.shape
        h = self.token_embd[tokens]
        for b in self.blocks:
            a = rms_norm(h, b.attn_norm, c.rms_eps)
            q, k, v = (a @ b.attn_qkv.T).split([c.hidden_size, c.kv_dim, c.kv_dim], dim=-1)
            q = apply_rope(q.reshape(bsz, n, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(k.reshape(bsz, n, c.num_kv_heads, c.head_dim), cos, sin)
            v = v.reshape(bsz, n, c.num_kv_heads, c.head_dim)
            # softmax(q k^T / sqrt(head_dim)) v, causal; query head h reads KV head h // group.
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True)
            h = h + o.transpose(1, 2).reshape(bsz, n, c.hidden_size) @ b.attn_output.T
            g, u = (rms_norm(h, b.ffn_norm, c.rms_eps) @ b.ffn_up.T).split(c.ffn_size, dim=-1)
            h = h + (F.silu(g) * u) @ b.ffn_down.T
        return rms_norm(h, self.output_norm, c.rms_eps) @ self.token_embd.T

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        params = dict(self.named_parameters())
        return {name: params[param].detach().float().numpy()
                for name, param in _gguf_names(self).items()}

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> "TinyPhi3":
        """This model with a GGUF's (dequantized) weights: for checking the export."""
        m = open_gguf(path)
        model = cls(m.config)
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, values in _gguf_names(model).items():
                params[values].copy_(torch.tensor(m.tensor(name).dequantize(np.float32)))
        m.close()
        return model


def _gguf_names(model: TinyPhi3) -> dict[str, str]:
    """GGUF tensor name -> this module's parameter name."""
    names = {"token_embd.weight": "token_embd", "output_norm.weight": "output_norm"}
    for i in range(model.config.num_layers):
        for part in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"):
            names[f"blk.{i}.{part}.weight"] = f"blocks.{i}.{part}"
    return names


def rope_cos_sin(c: ModelConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's tables for positions 0..n-1 in a window <= 4096 (short factors)."""
    half = c.rope_dims // 2
    spec = make_rope_spec(rope_dims=c.rope_dims, freq_base=c.rope_freq_base,
                          attn_factor=c.rope_attn_factor,
                          original_context_length=c.original_context_length,
                          context_window=min(n, c.original_context_length),
                          short_factors=np.ones(half), long_factors=np.ones(half))
    cos, sin = spec.tables(np.arange(n), np.float32)
    return torch.from_numpy(cos), torch.from_numpy(sin)


# -- data --------------------------------------------------------------------------------------

def tokenized_corpus(args: argparse.Namespace, work: Path, say) -> dict:
    """Corpus facts, the tokenizer, and the training/held-out token streams (cached in `work`)."""
    train, held = split(stdlib_corpus())
    if args.max_files is not None:  # a quick run: a prefix of each side
        train, held = train[:args.max_files], held[:max(1, args.max_files // 40)]
    files = train + held
    digest = corpus_sha256(files)
    key = hashlib.sha256(f"{digest}:{args.vocab_size}".encode()).hexdigest()[:16]
    cache = work / f"tokens-{key}.npz"
    vocab_file = work / f"vocab-{key}.json"
    if cache.exists() and vocab_file.exists():
        vocab = TokenizerData.model_validate_json(vocab_file.read_text())
        with np.load(cache) as z:
            train_ids, held_ids = z["train"], z["held"]
    else:
        t0 = time.perf_counter()
        vocab = build_trained_vocab([f.text for f in train], args.vocab_size)
        tok = Tokenizer.from_data(vocab)
        eot = vocab.eos_token_id

        def stream(fs) -> np.ndarray:
            ids: list[int] = []
            for f in fs:  # files joined by <|endoftext|>, as documents are
                ids += tok.encode(f.text)
                ids.append(eot)
            return np.asarray(ids, dtype=np.int32)

        train_ids, held_ids = stream(train), stream(held)
        _atomic_write(vocab_file, vocab.model_dump_json().encode())
        tmp = cache.with_name(cache.name + ".partial.npz")
        np.savez(tmp, train=train_ids, held=held_ids)
        os.replace(tmp, cache)
        say(f"tokenizer trained and corpus tokenized in {time.perf_counter() - t0:.1f}s")
    train_bytes = sum(len(f.text.encode()) for f in train)
    held_bytes = sum(len(f.text.encode()) for f in held)
    say(f"corpus: {len(files)} stdlib files ({len(train)} train, {len(held)} held out), "
        f"{train_bytes / 1e6:.2f} MB -> {len(train_ids)} tokens "
        f"({train_bytes / len(train_ids):.2f} bytes/token), sha256 {digest[:16]}...")
    return {"vocab": vocab, "train": train_ids, "held": held_ids, "sha256": digest,
            "files": len(files), "train_files": len(train), "held_files": [f.path for f in held],
            "train_bytes": train_bytes, "held_bytes": held_bytes}


def batch(ids: np.ndarray, seed: int, step: int, size: int, seq: int) -> torch.Tensor:
    """`size` random windows of seq+1 tokens: a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq - 1, size)
    return torch.from_numpy(np.stack([ids[s:s + seq + 1] for s in starts]).astype(np.int64))


def held_out_windows(ids: np.ndarray, seq: int, limit: int) -> torch.Tensor:
    n = min(limit, (len(ids) - 1) // seq)
    if n == 0:
        raise SystemExit(f"the held-out slice has {len(ids)} tokens, fewer than one window")
    return torch.from_numpy(np.stack([ids[i * seq:i * seq + seq + 1] for i in range(n)])
                            .astype(np.int64))


@torch.no_grad()
def held_out_loss(model: TinyPhi3, windows: torch.Tensor, cos, sin, chunk: int = 4) -> float:
    total, count = 0.0, 0
    for w in windows.split(chunk):
        logits = model(w[:, :-1], cos, sin)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += w[:, 1:].numel()
    return total / count


# -- training ----------------------------------------------------------------------------------

def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: TinyPhi3, args: argparse.Namespace) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                              {"params": vectors, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def run_signature(args: argparse.Namespace, corpus_hash: str) -> dict:
    """What a checkpoint must agree with to be resumed."""
    keys = ("dim", "layers", "kv_heads", "ffn", "vocab_size", "seq_len", "batch", "steps", "lr",
            "warmup", "weight_decay", "seed", "max_files")
    return {k: getattr(args, k) for k in keys} | {"corpus_sha256": corpus_hash}


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_checkpoint(path: Path, model, opt, step: int, wall: float, signature: dict,
                    log: list) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "wall_s": wall, "signature": signature, "log": log}, tmp)
    os.replace(tmp, path)


def train(args: argparse.Namespace, say=print) -> dict:
    torch.set_num_threads(args.threads)
    # The embedding's backward (index_put_ with accumulate) otherwise sums in thread order.
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also NaN-fills every new tensor (a debugging aid); nothing here reads
    # uninitialised memory, and the fill costs time.
    torch.utils.deterministic.fill_uninitialized_memory = False
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = tokenized_corpus(args, work, say)
    c = model_config(args)
    signature = run_signature(args, data["sha256"])
    model = TinyPhi3(c)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    opt = make_optimizer(model, args)
    say(f"model: {c.num_parameters():,} parameters (d={c.hidden_size}, {c.num_layers} layers, "
        f"heads {c.num_heads}/{c.num_kv_heads} of {c.head_dim}, rope {c.rope_dims}, "
        f"ffn {c.ffn_size}, vocab {c.vocab_size})")

    ckpt = work / "checkpoint.pt"
    step, wall_before, log = 0, 0.0, []
    if ckpt.exists() and not args.fresh:
        state = torch.load(ckpt, weights_only=False)
        if state["signature"] != signature:
            diff = {k: (state["signature"].get(k), v) for k, v in signature.items()
                    if state["signature"].get(k) != v}
            raise SystemExit(f"{ckpt} belongs to another run (checkpoint vs now: {diff}); pass "
                             "--fresh to start over or another --work-dir")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, wall_before, log = state["step"], state["wall_s"], state["log"]
        say(f"resumed from {ckpt} at step {step}")

    cos, sin = rope_cos_sin(c, args.seq_len)
    held = held_out_windows(data["held"], args.seq_len, args.eval_windows)
    stop = min(args.steps, args.stop_after or args.steps)
    started = since = time.perf_counter()
    tokens_per_step = args.batch * args.seq_len
    recent: list[float] = []
    while step < stop:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x = batch(data["train"], args.seed, step, args.batch, args.seq_len)
        logits = model(x[:, :-1], cos, sin)
        loss = F.cross_entropy(logits.reshape(-1, c.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(loss.item())
        elapsed = wall_before + time.perf_counter() - started
        if step % args.log_every == 0 or step == stop:
            mean = sum(recent) / len(recent)
            rate = tokens_per_step * len(recent) / (time.perf_counter() - since)
            say(f"step {step}/{args.steps}  loss {mean:.4f}  lr {lr_at(step - 1, args):.2e}  "
                f"{elapsed:.0f}s  {rate:.0f} tok/s", flush=True)
            log.append({"step": step, "train_loss": round(mean, 5), "wall_s": round(elapsed, 1)})
            recent, since = [], time.perf_counter()
        if step % args.eval_every == 0 or step == args.steps:
            t0 = time.perf_counter()
            hl = held_out_loss(model, held, cos, sin)
            say(f"   held-out loss {hl:.4f} nats/token ({time.perf_counter() - t0:.1f}s)",
                flush=True)
            log.append({"step": step, "held_out_loss": round(hl, 5)})
            since += time.perf_counter() - t0
        if step % args.checkpoint_every == 0 or step == stop:
            save_checkpoint(ckpt, model, opt, step, wall_before + time.perf_counter() - started,
                            signature, log)
    wall = wall_before + time.perf_counter() - started
    if step < args.steps:
        say(f"stopped at step {step} (--stop-after); resume with the same command minus "
            "--stop-after")
        return {"stopped_at": step}

    final = next((e["held_out_loss"] for e in reversed(log) if "held_out_loss" in e), None)
    if final is None:
        final = held_out_loss(model, held, cos, sin)
    return export(args, model, data, c, step, wall, final, log, say)


# -- export ------------------------------------------------------------------------------------

def export(args, model: TinyPhi3, data: dict, c: ModelConfig, steps: int, wall: float,
           held_loss: float, log: list, say) -> dict:
    out = Path(args.out)
    q8, f32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32
    tensors = longrope_factor_tensors(c)
    for name, values in model.gguf_tensors().items():
        tensors[name] = TensorSource.from_array(values, q8 if values.ndim == 2 else f32)
    write_gguf(out, c, data["vocab"], tensors, name="tiny-code")
    verification = verify_export(model, out, data["held"], c)
    say(f"exported {out} ({out.stat().st_size / 2**20:.2f} MiB); reference on the GGUF vs the "
        f"trained model: min cosine {verification['min_cosine_vs_trained']:.6f}, argmax "
        f"agreement {verification['argmax_agreement_vs_trained']:.4f}; vs the model with the "
        f"GGUF's Q8_0 weights: min cosine {verification['min_cosine_vs_q8_weights']:.7f}")
    bits_per_byte = held_loss / math.log(2) * len(data["held"]) / data["held_bytes"]
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "arguments": vars(args),  # every setting, defaults included
        "model": out.name,
        "corpus": {"what": "Python standard library source (*.py), see "
                           "ane_spec/model/stdlib_corpus.py for exclusions",
                   "python": sys.version.split()[0], "sha256": data["sha256"],
                   "files": data["files"], "train_files": data["train_files"],
                   "held_out_files": data["held_files"], "train_bytes": data["train_bytes"],
                   "held_out_bytes": data["held_bytes"], "train_tokens": int(len(data["train"])),
                   "held_out_tokens": int(len(data["held"]))},
        "config": c.model_dump(),
        "parameters": c.num_parameters(),
        "steps": steps, "batch": args.batch, "seq_len": args.seq_len,
        "tokens_seen": steps * args.batch * args.seq_len,
        "seed": args.seed, "threads": args.threads, "torch": torch.__version__,
        "wall_s": round(wall, 1),
        "final_held_out_loss": round(held_loss, 5),
        "final_held_out_loss_unit": "nats/token, torch fp32 weights, "
                                    f"{args.eval_windows} windows of {args.seq_len}",
        "held_out_bits_per_byte_estimate": round(bits_per_byte, 4),
        "verification": verification,
        "log": log,
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    return report


@torch.no_grad()
def verify_export(model: TinyPhi3, path: Path, held: np.ndarray, c: ModelConfig,
                  n: int = 256) -> dict:
    """The project's reference on the written GGUF vs this model, over `n` held-out positions.

    Against the trained fp32 weights the only difference is Q8_0 rounding; against this model
    loaded with the GGUF's own (dequantized) weights there is none, so cosine ~1 - 1e-7.
    """
    tokens = [int(t) for t in held[:n]]
    ref = ReferenceModel(open_gguf(path), context_window=n).logits(tokens)
    cos, sin = rope_cos_sin(c, len(tokens))
    x = torch.tensor([tokens])
    trained = model(x, cos, sin)[0].numpy()
    q8 = TinyPhi3.from_gguf(path)(x, cos, sin)[0].numpy()

    def cosine(a, b):
        return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))

    return {"positions": len(tokens),
            "min_cosine_vs_trained": float(cosine(ref, trained).min()),
            "argmax_agreement_vs_trained": float((ref.argmax(-1) == trained.argmax(-1)).mean()),
            "min_cosine_vs_q8_weights": float(cosine(ref, q8).min()),
            "argmax_agreement_vs_q8_weights": float((ref.argmax(-1) == q8.argmax(-1)).mean())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="local-artifacts/tiny-code/tiny-code.Q8_0.gguf")
    p.add_argument("--work-dir", default="local-artifacts/tiny-code-train",
                   help="tokenized corpus cache and checkpoint.pt")
    p.add_argument("--steps", type=int, default=1300, help="total steps (sets the LR schedule)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="checkpoint and stop at this step; a later run resumes")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=256, help="hidden size (heads = dim / 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-files", type=int, default=None,
                   help="quick runs: the first N training files and N/40 (>= 1) held-out ones")
    # One thread: on the shared 2-core machine, with other jobs running, it beat two (1100 vs
    # 670 tok/s measured); on an idle machine pass --threads 2.
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=325)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=100)
    args = p.parse_args(argv)
    if args.dim % HEAD_DIM:
        p.error(f"--dim must be a multiple of the head size {HEAD_DIM}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = train(args)
    if "stopped_at" not in report:
        print(json.dumps({k: report[k] for k in ("parameters", "steps", "wall_s",
                                                  "final_held_out_loss")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
