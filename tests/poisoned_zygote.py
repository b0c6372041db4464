"""A sandbox zygote whose children find CUDA unusable after the fork, as a zygote that had
initialized CUDA before forking leaves them (tests/test_sandbox_children.py): torch's flag for it
is set in every child, whatever this host's GPU.

    python -m tests.poisoned_zygote CONTROL_FD DEVICE
"""
import torch

from workers.sandbox import zygote

torch.cuda._is_in_bad_fork = lambda: True

if __name__ == "__main__":
    zygote.main()
