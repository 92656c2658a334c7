"""Prototype: save/load the fsdp2 backend's output through torch's AOT compile (aot_compile_module)."""
import json, os, sys, time, pickle
import torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, gpt_loss, make_batch
import fsdp2_compile as fc
from fsdp2_compile.api import make_backend
import fsdp2_compile.compiler.backend as B
from torch._inductor.output_code import RegionalOutputCode
from torch._dynamo.aot_compile import ModelInput

from fsdp2_compile._torch_private import boxed_call as _orig_boxed_call
from proto_helpers import _no_meta, input_guards_only
def boxed_call(gm):
    _orig_boxed_call(gm)  # sets boxed codegen
    return RegionalOutputCode(gm, ops_filter=None, node_metadata_key_filter=_no_meta)
B.boxed_call = boxed_call
B.BackwardBySync = lambda gm, compile_one, infos: compile_one(gm)

import torch._dynamo.guards as G
_orig_pgs = G.pickle_guards_state
def pgs(state, builder):
    try:
        return _orig_pgs(state, builder)
    except AssertionError:
        from proto_helpers import find_paths
        is_ours = lambda o: getattr(o, "_fsdp2_generated", False) and (isinstance(o, type) or True)
        print("PATHS", find_paths(state, lambda o: isinstance(o, type) and getattr(o, "_fsdp2_generated", False)), flush=True)
        print("PATHS-inst", find_paths(state, lambda o: not isinstance(o, type) and getattr(type(o), "_fsdp2_generated", False)), flush=True)
        raise
G.pickle_guards_state = pgs
mode, layers, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=8192, block_size=256, n_layer=layers, n_head=8, d_model=512)
model = GPT(cfg)
for block in model.blocks:
    fc.shard(block)
fc.shard(model)
torch._dynamo.config.enable_aot_compile = True
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
local = 8 // world
file = f"{path}.rank{rank}"
losses, times = [], []
for step in range(3):
    x, y = make_batch(cfg, 8, 256, seed=step)
    x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    dist.barrier()
    t0 = time.perf_counter()
    if step == 0:
        om = torch.compile(model, fullgraph=True, backend=make_backend(fc.CompileConfig()), options={"guard_filter_fn": input_guards_only})
        if mode == "cold":
            om._aot_compile([ModelInput(args=(x,), kwargs={}, contexts=[])])
            t1 = time.perf_counter()
            om._save_aot_compiled_module(file)
            save_s = time.perf_counter() - t1
        elif mode == "warm":
            with open(file, "rb") as f:
                om._load_aot_compiled_module(f.read())
            save_s = time.perf_counter() - t0
        else:  # jit: the ordinary lazy path
            om = torch.compile(model, fullgraph=True, backend=make_backend(fc.CompileConfig()))
            save_s = 0.0
    loss = gpt_loss(om(x), y)
    loss.backward()
    opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
if rank == 0:
    print(json.dumps(dict(mode=mode, layers=layers, first_step_s=times[0], save_s=save_s, steps_s=times, losses=[float.hex(l) for l in losses])), flush=True)
dist.destroy_process_group()
