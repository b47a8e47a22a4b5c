"""Train the demo model quasar-deploy ships: a small Qwen3 on the Python standard library.

Why this exists: nothing can be downloaded at run time, and a random-weight model
says nothing about acceptance rates or quantization fidelity. Every machine with
CPython has its standard library, so the corpus is offline and the recipe is
reproducible (fixed seed; the corpus fingerprint lands in the model card).

    python tools/train_demo_model.py --output quasar_deploy/demo_model

The run is budgeted in optimizer steps, not wall time, so a rerun on the same
Python version gives the same model up to floating-point nondeterminism.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS = "<|endoftext|>"
SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
HELD_OUT_EVERY = 20  # one file in twenty (by path hash) is held out


def corpus_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS.isdisjoint(path.relative_to(root).parts[:-1]):
            files.append(path)
    return files


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def read_texts(root: Path) -> tuple[list[str], list[str], str]:
    train, held = [], []
    digest = hashlib.sha256()
    for path in corpus_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        digest.update(rel.encode())
        digest.update(text.encode())
        (held if is_held_out(rel) else train).append(text)
    return train, held, digest.hexdigest()


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab_size: int, eos_id: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def batches(stream: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    high = len(stream) - seq_len - 1
    while True:
        starts = torch.randint(0, high, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def mean_loss(model: Qwen3ForCausalLM, stream: torch.Tensor, seq_len: int, max_chunks: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(min(max_chunks, (len(stream) - 1) // seq_len)):
        chunk = stream[i * seq_len : (i + 1) * seq_len + 1].unsqueeze(0)
        logits = model(chunk[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        count += seq_len
    model.train()
    return total / count


def unigram_loss(train: torch.Tensor, held: torch.Tensor, vocab_size: int) -> float:
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[held].mean())


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_continuations(model, tokenizer, prompts: list[str], temperature: float, seed: int) -> list[str]:
    model.eval()
    outs = []
    for prompt in prompts:
        torch.manual_seed(seed)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
        gen = model.generate(ids, max_new_tokens=64, pad_token_id=tokenizer.eos_token_id, **kwargs)
        outs.append(tokenizer.decode(gen[0, ids.shape[1] :]))
    return outs


CARD_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
]


def write_card(out: Path, facts: dict, greedy: list[str], sampled: list[str]) -> None:
    lines = [
        "# quasar-deploy demo model",
        "",
        "A small Qwen3-architecture causal LM (`Qwen3ForCausalLM`) trained from scratch on the",
        "Python standard library's own source files, so that every machine can rebuild it offline.",
        "It writes Python-looking code; it is not an assistant. It exists so that quasar-deploy's",
        "demo, tests and benchmarks run on a real trained model (acceptance rates and quantization",
        "fidelity mean something), without any download.",
        "",
        "| fact | value |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {v} |" for k, v in facts.items()]
    lines += [
        "",
        "Reproduce (fixed seed; the corpus depends on the Python version, whose fingerprint is above):",
        "",
        "    python tools/train_demo_model.py --output quasar_deploy/demo_model",
        "",
        "## Greedy continuations",
        "",
    ]
    for prompt, text in zip(CARD_PROMPTS, greedy):
        lines += ["```python", prompt + text, "```", ""]
    lines += ["## Sampled continuations (temperature 0.8, seed 0)", ""]
    for prompt, text in zip(CARD_PROMPTS, sampled):
        lines += ["```python", prompt + text, "```", ""]
    (out / "README.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    root = Path(sysconfig.get_paths()["stdlib"])
    train_texts, held_texts, fingerprint = read_texts(root)
    print(f"corpus: {len(train_texts)} train files, {len(held_texts)} held-out files from {root}", flush=True)

    tokenizer = train_tokenizer(train_texts, args.vocab)
    train_ids = encode_stream(tokenizer, train_texts)
    held_ids = encode_stream(tokenizer, held_texts)
    print(f"tokens: {len(train_ids):,} train, {len(held_ids):,} held out", flush=True)

    config = model_config(len(tokenizer), tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.seq_len, args.batch, gen)
    warmup = max(1, args.steps // 30)
    start = time.time()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        chunk = next(data)
        loss = model(chunk[:, :-1], labels=chunk[:, :-1].clone(), use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            done = (step + 1) * args.batch * args.seq_len
            rate = done / (time.time() - start)
            print(f"step {step}/{args.steps} loss {loss.item():.3f} {rate:,.0f} tok/s", flush=True)
    train_s = time.time() - start

    held_loss = mean_loss(model, held_ids, args.seq_len, max_chunks=200)
    base_loss = unigram_loss(train_ids, held_ids, len(tokenizer))
    print(f"held-out loss {held_loss:.3f} (ppl {math.exp(held_loss):.1f}); unigram {base_loss:.3f}", flush=True)

    greedy = sample_continuations(model, tokenizer, CARD_PROMPTS, 0.0, args.seed)
    sampled = sample_continuations(model, tokenizer, CARD_PROMPTS, 0.8, args.seed)

    out = args.output.resolve()
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-demo-", dir=out.parent))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, do_sample=False)
    model.to(torch.float16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    facts = {
        "architecture": "Qwen3ForCausalLM, 6 layers, hidden 256, 4 heads (2 KV), MLP 768, tied embeddings",
        "parameters": f"{n_params:,}",
        "stored dtype": "float16 (load in float32)",
        "tokenizer": f"byte-level BPE, {len(tokenizer)} tokens, trained on the same corpus",
        "corpus": f"CPython {'.'.join(map(str, __import__('sys').version_info[:3]))} standard library *.py, tests excluded",
        "corpus fingerprint (sha256)": fingerprint,
        "train / held-out tokens": f"{len(train_ids):,} / {len(held_ids):,} (held out: 1 file in {HELD_OUT_EVERY} by path hash)",
        "steps x batch x seq": f"{args.steps} x {args.batch} x {args.seq_len} ({args.steps * args.batch * args.seq_len:,} tokens)",
        "optimizer": f"AdamW, peak lr {args.lr}, warmup {warmup}, cosine to 10%, wd 0.1, seed {args.seed}",
        "held-out loss / perplexity": f"{held_loss:.3f} / {math.exp(held_loss):.1f}",
        "unigram baseline loss / perplexity": f"{base_loss:.3f} / {math.exp(base_loss):.1f}",
        "training time": f"{train_s / 60:.0f} min on {args.threads} CPU threads (fp32)",
    }
    (tmp / "training.json").write_text(json.dumps(facts, indent=2))
    write_card(tmp, facts, greedy, sampled)
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
