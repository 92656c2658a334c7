import os
import shutil
import sys
import tempfile

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


# `CompileConfig(cache_dir="auto")` saves in a directory of this test run's (with Inductor's caches), emptied
# before each test, so that no test loads what another saved.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fsdp2-compile-tests-")


@pytest.fixture(autouse=True)
def _no_saved_compiles():
    shutil.rmtree(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "fsdp2_compile"), ignore_errors=True)
