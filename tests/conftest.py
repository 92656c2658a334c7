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


def pytest_configure(config):
    """Compiles saved by default (`CompileConfig(cache_dir="auto")`, under Inductor) go to a directory of this run's,
    removed afterwards; ranks a test spawns inherit it."""
    os.environ["FSDP2_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="fsdp2-compile-tests-")


def pytest_unconfigure(config):
    shutil.rmtree(os.environ.pop("FSDP2_COMPILE_CACHE_DIR", ""), ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_saved_compiles():
    """Emptied before each test, so that no test loads what another saved."""
    shutil.rmtree(os.environ["FSDP2_COMPILE_CACHE_DIR"], ignore_errors=True)
