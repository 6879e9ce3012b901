"""Character-level LSTM language model, trained with autograd and through ``spscan.wrap`` side by side.

Embedding -> ``nn.LSTM`` -> Linear, with a cross-entropy loss on the next character at every step. The
whole model is wrapped with ``spscan.wrap``, and an ordinary ``loss.backward()`` trains it. The text is
synthetic (no downloads): a random Markov source over 28 characters in which each character has a few
likely successors, so the loss falls from ln 28 = 3.33 towards the source's entropy as the model learns.

    python examples/char_lm.py                   # T = 256, B = 16, hidden 64, 20 timed steps per side
    python examples/char_lm.py --quick           # T = 64, a few seconds
    python examples/char_lm.py --device cuda --steps 100
"""

from __future__ import annotations

import itertools
import random

import torch
from torch import nn

from _side_by_side import parse, parser, train_side_by_side

ALPHABET = "abcdefghijklmnopqrstuvwxyz ."


class CharLM(nn.Module):
    def __init__(self, vocab: int = len(ALPHABET), embed: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:   # tokens: (B, T) -> logits (B, T, vocab)
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


def markov_text(length: int, seed: int) -> torch.Tensor:
    """Token ids of a random Markov source: each character goes to one of 3 successors most of the time."""
    rng = random.Random(seed)
    v = len(ALPHABET)
    weights = []
    for _ in range(v):
        w = [0.1 / v] * v
        for c in rng.sample(range(v), 3):
            w[c] += 0.3
        weights.append(list(itertools.accumulate(w)))
    text = [0]
    for _ in range(length - 1):
        text.append(rng.choices(range(v), cum_weights=weights[text[-1]])[0])
    return torch.tensor(text)


def batches_of(text: torch.Tensor, n_batches: int, batch: int, seq_len: int, device: str, seed: int):
    """``(input, target)`` pairs: random windows of the text and the same windows shifted by one."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n_batches):
        starts = torch.randint(0, len(text) - seq_len - 1, (batch,), generator=g)
        window = torch.stack([text[s:s + seq_len + 1] for s in starts.tolist()])
        out.append((window[:, :-1].to(device), window[:, 1:].to(device)))
    return out


def next_char_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=20, quick_steps=4)
    p.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    p.add_argument("--seq-len", type=int, default=None, help="characters per sequence (default 256; 64 with --quick)")
    p.add_argument("--hidden", type=int, default=64, help="LSTM hidden size (default 64)")
    args = parse(p)
    seq_len = args.seq_len or (64 if args.quick else 256)
    print(f"char LM: Embedding({len(ALPHABET)}, 16) -> nn.LSTM(16, {args.hidden}) -> Linear, "
          f"T = {seq_len}, batch {args.batch}, on {args.device}")
    model = CharLM(hidden=args.hidden).to(args.device)
    text = markov_text(20_000, args.seed)
    batches = batches_of(text, 16, args.batch, seq_len, args.device, args.seed)
    train_side_by_side(model, batches, next_char_loss, steps=args.steps,
                       warmup=1 if args.quick else 2, lr=1e-2)


if __name__ == "__main__":
    main()
