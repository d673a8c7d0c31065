"""Example: the main job as a script (see experiments/train.py for the options).

    horovodrun -np 2 -H localhost:2 python examples/train_torch.py --config topk_raw
"""
from experiments.train import main

if __name__ == "__main__":
    raise SystemExit(main())
