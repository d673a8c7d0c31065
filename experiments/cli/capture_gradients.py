"""``deepreduce capture-gradients``: train ResNet-20 briefly and save real gradients for benchmarks."""
from __future__ import annotations


def register(subparsers) -> None:
    from ..gradients import DEFAULT_PATH, DEFAULT_STEPS

    parser = subparsers.add_parser("capture-gradients",
                                   help="save real ResNet-20 gradients (experiments/data/gradients.npz)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps before the capture")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=DEFAULT_PATH, help="npz file to write")
    parser.set_defaults(func=run)


def run(args) -> int:
    import time

    from ..gradients import capture, save

    start = time.perf_counter()
    grads = capture(steps=args.steps, seed=args.seed)
    path = save(grads, args.output)
    sizes = ", ".join(f"{k} ({v.size})" for k, v in grads.items() if v.size >= 9216 or k == "all")
    print(f"saved {len(grads)} gradients to {path} in {time.perf_counter() - start:.1f} s; large ones: {sizes}")
    return 0
