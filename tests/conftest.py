import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def fake_pg():
    """A fake default process group: rank 3 of 4, in this process only (collectives do nothing). DTensor's caches
    are cleared after it: they hold meshes of the destroyed group."""
    from fsdp2_compile._torch_private import clear_dtensor_caches, fake_process_group

    fake_process_group(rank=3, world_size=4)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()
    clear_dtensor_caches()
