#!/usr/bin/env python3
"""torch.compile (inductor) against PyTorch eager on kiln's zoo architectures.

The peer a PyTorch user would pick instead of kiln. Same architectures as kiln's zoo (restated
in plain `torch.nn` by `torch_reference.py`), same input sizes (batch 4 of 3x64x64 images,
BERT token ids [4, 64], `linear` randn(2, 10)), same training step as kiln-bench (train mode,
loss = mean of the output, backward, SGD lr 0.01) and the same method: warm-up calls first
(the first compiled call compiles; its time is reported separately), then `--repeat`
repetitions that each time one eager call and one compiled call, medians reported.

Both sides run in one process with the same intra-op threads: libtorch's default (one per
core) unless `--threads N`. Inference runs under `torch.no_grad()` in eval mode; the compiled
output is checked against eager (rtol 1e-3, atol 1e-4) before timing.

    .deps/venv/bin/python scripts/torch_compile_bench.py                # default subset, inference
    .deps/venv/bin/python scripts/torch_compile_bench.py --training
    .deps/venv/bin/python scripts/torch_compile_bench.py --models resnet18,bert --threads 1
"""

import argparse
import copy
import csv
import math
import os
import statistics
import sys
import time

# OpenMP waits as PyTorch users have it (libgomp's default, unless OMP_WAIT_POLICY is set):
# as in kiln-bench, neither side is run under a policy its users would not have.

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import MODELS  # noqa: E402

# kiln-bench's default subset (kiln_bench::DEFAULT_SUBSET).
DEFAULT_SUBSET = ["resnet18", "mobilenet_v2", "squeezenet1_1", "bert", "vit", "linear"]
BERT_VOCAB = 30522
BERT_SEQ = 64
IMAGE_SIZE = 64


def linear_model():
    """kiln's `LinearModel`: two 10x10 linears (torchbench.py's example model)."""
    return nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))


ALL_MODELS = dict(MODELS, linear=linear_model)


def example_input(name, batch, gen):
    if name == "bert":
        return torch.randint(0, BERT_VOCAB, (batch, BERT_SEQ), generator=gen)
    if name == "linear":
        return torch.randn(batch, 10, generator=gen)
    return torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def inference_case(model, x):
    model.eval()

    def run():
        with torch.no_grad():
            return model(x)

    return run


def training_case(model, x, lr):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run():
        opt.zero_grad(set_to_none=True)
        loss = model(x).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return run


def bench_model(name, args):
    batch = args.batch_size or (2 if name == "linear" else 4)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    eager_model = ALL_MODELS[name]()
    compiled_base = copy.deepcopy(eager_model)
    compiled_model = torch.compile(compiled_base, mode=args.compile_mode)
    x = example_input(name, batch, gen)

    if args.training:
        eager = training_case(eager_model, x, args.lr)
        compiled = training_case(compiled_model, x, args.lr)
    else:
        eager = inference_case(eager_model, x)
        compiled = inference_case(compiled_model, x)

    # The first compiled call compiles (and, in training, also differentiates ahead of time).
    first_eager = eager()
    start = time.perf_counter()
    first_compiled = compiled()
    compile_s = time.perf_counter() - start
    # Same initial parameters and input: the first results agree (the first training step's
    # loss comes before any update).
    ok = torch.allclose(first_compiled.float(), first_eager.float(), rtol=1e-3, atol=1e-4)
    err = (first_compiled.float() - first_eager.float()).abs().max().item()
    # In training mode, dropout draws its masks from eager's generator on one side and from
    # inductor's in-kernel Philox on the other: their losses are not comparable.
    dropout = args.training and any(
        isinstance(m, nn.Dropout) and m.p > 0 for m in eager_model.modules())
    accuracy = "pass" if ok else f"FAIL (max abs err {err:.3g})"
    if dropout:
        accuracy = f"n/a: dropout (max abs err {err:.3g})"

    for _ in range(args.warmup - 1):
        eager()
        compiled()
    t_eager, t_compiled = [], []
    for _ in range(args.repeat):
        t_eager.append(timed(eager))
        t_compiled.append(timed(compiled))
    e = statistics.median(t_eager)
    c = statistics.median(t_compiled)
    return {
        "model": name,
        "batch": batch,
        "eager_ms": e * 1e3,
        "compiled_ms": c * 1e3,
        "speedup": e / c,
        "compile_s": compile_s,
        "accuracy": accuracy,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_SUBSET),
                    help="comma-separated; `all` for every zoo model")
    ap.add_argument("--training", action="store_true")
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads for both sides (0: libtorch's default)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode (default inductor settings; e.g. max-autotune)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    names = sorted(ALL_MODELS) if args.models == "all" else args.models.split(",")
    for n in names:
        if n not in ALL_MODELS:
            ap.error(f"unknown model {n!r}; known: {', '.join(sorted(ALL_MODELS))}")

    kind = "training (SGD step)" if args.training else "inference"
    print(f"# torch.compile vs eager, {kind}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads on both sides, "
          f"{os.cpu_count()} CPUs; medians of {args.repeat}")
    header = f"{'model':<16}{'eager ms':>10}{'compiled ms':>13}{'speedup':>9}{'compile s':>11}  accuracy"
    print(header)
    rows = []
    for name in names:
        r = bench_model(name, args)
        rows.append(r)
        print(f"{r['model']:<16}{r['eager_ms']:>10.2f}{r['compiled_ms']:>13.2f}"
              f"{r['speedup']:>8.2f}x{r['compile_s']:>11.1f}  {r['accuracy']}", flush=True)
    geo = math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows))
    print(f"{'geomean':<16}{'':>10}{'':>13}{geo:>8.2f}x")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["threads", "torch"])
            w.writeheader()
            for r in rows:
                w.writerow(dict(r, threads=torch.get_num_threads(), torch=torch.__version__))
    return 1 if any(r["accuracy"].startswith("FAIL") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
