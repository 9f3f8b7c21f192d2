"""One rank of a sharded trainer, for tests/services/learner/test_parallel.py: run under
``torchrun --nproc-per-node N``.

``ranks_worker.py MODEL EXPERIENCE OUT [--load FOLDER] [--save FOLDER] [--snapshot FOLDER] [--updates K]
[--set key=value ...]``: builds the learner's trainer (FSDP2 over the launcher's ranks), optionally loads a
checkpoint, applies ``EXPERIENCE`` (a ``torch.save``d :class:`services.learner.trainer.Experience`) K times,
optionally saves a checkpoint and writes sharded actor and critic snapshots (a part from each rank) into a weight
store, and on rank 0 writes the full actor and critic states, the snapshots and the last update's statistics to
``OUT``. Rank 0 leads, the others follow, as in the learner service.
"""

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config import AlgorithmSection, LearnerSection  # noqa: E402
from common.models import load_actor, load_critic, load_tokenizer  # noqa: E402
from common.weights import WeightStore  # noqa: E402
from services.learner.parallel import init_ranks, shard_model  # noqa: E402
from services.learner.trainer import PPOTrainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("experience")
    parser.add_argument("out")
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--snapshot")
    parser.add_argument("--updates", type=int, default=1)
    parser.add_argument("--set", nargs="*", default=[])
    args = parser.parse_args()
    settings = {}
    for item in args.set:
        key, _, value = item.partition("=")
        settings[key] = int(value) if value.isdigit() else value
    learner = LearnerSection(**trainer_settings(settings))
    ranks = init_ranks("fsdp", int(os.environ.get("WORLD_SIZE", "1")), "cpu")
    torch.manual_seed(0)
    trainer = PPOTrainer(
        shard_model(load_actor(args.model), ranks, torch.float32),
        shard_model(load_critic(args.model), ranks, torch.float32),
        learner,
        AlgorithmSection(),
        temperature=1.0,
        pad_token_id=load_tokenizer(args.model).pad_token_id,
        ranks=ranks,
    )
    if not ranks.leads:
        ranks.follow(trainer)
        trainer.release()
        return
    if args.load:
        trainer.load(args.load)
    exp = torch.load(args.experience, weights_only=False)
    for _ in range(args.updates):
        stats = trainer.train(exp)
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        trainer.save(args.save)
    snapshots = {}
    if args.snapshot:
        store = WeightStore(args.snapshot)
        for name in ("actor", "critic"):
            write = functools.partial(trainer.write_snapshot_parts, name, "float32", digest="blake3")
            snapshots[name] = store.save_sharded(name, trainer.version, lambda folder, write=write: write(folder))
    states = {name: trainer.full_state(name) for name in ("actor", "critic")}
    trainer.release()
    torch.save({"states": states, "stats": stats, "version": trainer.version, "snapshots": snapshots}, args.out)


def trainer_settings(overrides: dict) -> dict:
    """The learner settings both sides of a comparison use."""
    return dict(ppo_epochs=2, mini_batch_size=4, actor_lr=1e-4, critic_lr=1e-4) | overrides


if __name__ == "__main__":
    main()
