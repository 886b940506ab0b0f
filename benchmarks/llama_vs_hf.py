"""The built-in llama against transformers' LlamaForCausalLM of the same shape: tokens/s and peak memory.

Each arm runs in a fresh process (so neither inherits the other's allocations), alternately, `--repeats`
times: the same weights (the built-in model's state_dict loaded into the transformers one), the same
batches, forward + cross-entropy + backward + AdamW step, `--warmup` steps untimed then `--steps` timed.
Peak memory is the process's peak RSS (ru_maxrss) less its RSS before the model was built. Prints each
arm's median and the ratios built-in / transformers: the median of the ratios of back-to-back pairs (what
another load on the machine shifts least) and the ratio of the medians.

    python benchmarks/llama_vs_hf.py                  # presets small and base -> benchmarks/results/llama-vs-hf.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def arm(name: str, preset: str, *, vocab: int, batch: int, seq: int, steps: int, warmup: int,
        threads: int) -> dict[str, Any]:
    import psutil
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    from swarmtrain.config import load_config
    from swarmtrain.models import build_model

    base_rss = psutil.Process().memory_info().rss
    cfg = load_config(overrides=["model.arch=llama", f"model.preset={preset}", f"model.vocab_size={vocab}",
                                 f"data.seq_len={seq}", "data.tokenizer=unused.json"])
    ours = build_model(cfg.model, seed=0)
    if name == "builtin":
        model = ours

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return model(x, y)[1]
    else:
        import transformers

        s = ours.shape
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=s.n_embd, intermediate_size=s.intermediate_size, num_hidden_layers=s.n_layer,
            num_attention_heads=s.n_head, num_key_value_heads=s.n_kv_head, max_position_embeddings=s.context_len,
            rms_norm_eps=ours.norm_eps, rope_theta=ours.rope_theta, tie_word_embeddings=False, use_cache=False)
        model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(ours.state_dict())
        del ours

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=x).logits
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(warmup + steps)]
    for i, chunk in enumerate(data):
        if i == warmup:
            start = time.perf_counter()
        loss_of(chunk[:, :-1], chunk[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"arm": name, "tokens_per_s": steps * batch * seq / seconds, "peak_mb": (peak - base_rss) / 2**20,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["small", "base"])
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("ARM", "PRESET"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "llama-vs-hf.json")
    args = p.parse_args()
    kw = dict(vocab=args.vocab_size, batch=args.batch_size, seq=args.seq_len, steps=args.steps, warmup=args.warmup,
              threads=args.threads)
    if args.child:
        print(json.dumps(arm(args.child[0], args.child[1], **kw)))  # type: ignore[arg-type]
        return 0
    rows = []
    for preset in args.presets:
        runs: dict[str, list[dict[str, Any]]] = {"builtin": [], "transformers": []}
        for _ in range(args.repeats):
            for name in runs:
                out = subprocess.run([sys.executable, __file__, "--child", name, preset, *sys.argv[1:]], check=True,
                                     capture_output=True, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "peak_mb")}
               for name, rs in runs.items()}
        pairs = [a["tokens_per_s"] / b["tokens_per_s"]
                 for a, b in zip(runs["builtin"], runs["transformers"], strict=True)]
        row = {"preset": preset, "params": runs["builtin"][0]["params"], "runs": runs, "median": med,
               "speed_ratio": statistics.median(pairs), "pair_speed_ratios": pairs,
               "speed_ratio_of_medians": med["builtin"]["tokens_per_s"] / med["transformers"]["tokens_per_s"],
               "memory_ratio": med["builtin"]["peak_mb"] / med["transformers"]["peak_mb"]}
        rows.append(row)
        print(f"{preset} ({row['params']:,} parameters, vocab {args.vocab_size}, "
              f"batch {args.batch_size}x{args.seq_len}): "
              f"built-in {med['builtin']['tokens_per_s']:,.0f} tok/s, {med['builtin']['peak_mb']:.0f} MB; transformers "
              f"{med['transformers']['tokens_per_s']:,.0f} tok/s, {med['transformers']['peak_mb']:.0f} MB; speed "
              f"{row['speed_ratio']:.3f}x (median of pairs; {min(pairs):.3f}-{max(pairs):.3f}), memory "
              f"{row['memory_ratio']:.3f}x", flush=True)
    args.out.write_text(json.dumps({"machine": f"{os.cpu_count()} CPUs", "threads": args.threads, "rows": rows},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
