"""Compute GRPO and GSPO losses on a toy batch and show how they differ.

Two answers to one prompt, the second twice as long; the policy moved a little since sampling.
"""

import torch

from gspo.algo.advantages import group_advantages
from gspo.algo.objectives import policy_loss


def main() -> None:
    rewards = torch.tensor([1.0, 0.0])  # (N,) one right, one wrong answer
    adv = group_advantages(rewards, group_size=2)  # (N,)
    old = torch.tensor([[-1.0, -0.5, 0.0, 0.0], [-2.0, -1.0, -0.7, -0.3]])  # (N, T)
    new = old + torch.tensor([[2e-4, 3e-4, 0.0, 0.0], [-1e-4, 5e-4, 0.3, -0.2]])  # (N, T)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])  # (N, T)
    print(f"advantages: {adv.tolist()}")
    for objective in ("grpo", "gspo", "gspo_token", "cispo", "sapo"):
        loss, stats = policy_loss(new, old, adv, mask, objective=objective)
        print(f"{objective:>10}: loss {loss.item():+.5f}  ratio mean {stats['ratio/mean'].item():.5f}  "
              f"clip low/high {stats['clip/low_frac'].item() if 'clip/low_frac' in stats else float('nan'):.2f}/"
              f"{stats['clip/high_frac'].item() if 'clip/high_frac' in stats else float('nan'):.2f}")


if __name__ == "__main__":
    main()
