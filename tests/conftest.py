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


@pytest.fixture(scope="session", autouse=True)
def _saved_compiles_dir():
    """Compiles saved by default (`CompileConfig(cache_dir="auto")`, under Inductor) go to a directory of this run's,
    removed afterwards; ranks a test spawns inherit it."""
    path = tempfile.mkdtemp(prefix="fsdp2-compile-tests-")
    os.environ["FSDP2_COMPILE_CACHE_DIR"] = path
    yield
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_saved_compiles(_saved_compiles_dir):
    """Emptied before each test, so that no test loads what another saved."""
    shutil.rmtree(os.environ["FSDP2_COMPILE_CACHE_DIR"], ignore_errors=True)
