"""Models, batches, the single-process references and the per-rank jobs of tests/test_real_models.py: Hugging Face
`transformers` models used unmodified, a model with graph breaks, changing sequence lengths and bad input.

The jobs are module level, so spawned ranks can import them; `train_steps` is the one training loop, run by the
sharded ranks on their slice of each global batch and by the references on the whole batch of an unsharded model.
"""

from __future__ import annotations

import io
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import local_slice
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2_compile as fc
from fsdp2_compile.compiler.graph_records import (
    clear_compiled_graphs,
    collectives,
    compile_counts,
    compiled_graphs,
)

GLOBAL_BATCH = 8
VOCAB = 64
SEQ = 16
CHANGING_SEQS = (8, 12, 16, 8)


# --- models and data -------------------------------------------------------------------------------------------


def hf_model(name: str) -> tuple[nn.Module, nn.ModuleList]:
    """A tiny `transformers` causal LM with random weights (seed 0), tied input/output embeddings, no dropout; and
    its decoder layers. "llama": RMSNorm, rotary, grouped-query attention (4 query heads, 2 key/value heads),
    SwiGLU. "gpt2": LayerNorm, learned positions, Conv1D projections."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=True,
            attention_dropout=0.0,
            attn_implementation="sdpa",
            bos_token_id=0,
            eos_token_id=0,
            initializer_range=0.2,
        )
        model = LlamaForCausalLM(cfg)
        layers = model.model.layers
    elif name == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
            bos_token_id=0,
            eos_token_id=0,
            initializer_range=0.2,
        )
        model = GPT2LMHeadModel(cfg)
        layers = model.transformer.h
    else:
        raise ValueError(f"unknown model {name!r}")
    return model.train(), layers


def token_batch(step: int, seq: int = SEQ) -> torch.Tensor:
    """The global batch of token ids of `step`: runs of consecutive tokens (mod VOCAB) from random starts, so the
    next token (labels=ids) is learnable and the loss falls."""
    g = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    return (start + torch.arange(seq)) % VOCAB


class BranchyNet(nn.Module):
    """A forward with two graph breaks: a `print`, then a Python branch on the input's values. `fc1` is read on
    both sides of the first break; the branch applies `fc2` or `fc3`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.log = io.StringIO()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        print("hidden", tuple(h.shape), file=self.log)  # graph break
        h = torch.tanh(self.fc1(h)) + h
        if x.mean() > 0:  # data-dependent branch: graph break
            h = self.fc2(h)
        else:
            h = self.fc3(h)
        return self.head(torch.tanh(h))


def branchy_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs centred on +3 at even steps and -3 at odd ones, so every rank's slice takes the same branch and both
    branches are taken; targets."""
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g) + (3.0 if step % 2 == 0 else -3.0)
    return x, torch.randn(GLOBAL_BATCH, 1, generator=g)


def hf_loss(model: nn.Module, step: int, seq: int, rank: int, world_size: int) -> torch.Tensor:
    ids = local_slice(token_batch(step, seq), rank, world_size)
    return model(input_ids=ids, labels=ids).loss  # the model's own loss (mean over the local batch's tokens)


def branchy_loss(model: nn.Module, step: int, rank: int, world_size: int) -> torch.Tensor:
    x, y = branchy_batch(step)
    return F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))


def train_steps(
    model: nn.Module,
    steps: int,
    loss_of: Callable[[nn.Module, int, int, int], torch.Tensor],
    rank: int = 0,
    world_size: int = 1,
) -> dict:
    """AdamW steps on `loss_of(model, step, rank, world_size)`. Returns each step's loss averaged over the ranks
    ("losses"), the full gradients of the first step ("grads": unlike AdamW's steps, they show a wrongly scaled
    gradient) and the full parameters after the last step ("params").

    AdamW's eps is 1e-5, above the rounding noise (~1e-8) of gradients that are zero in exact arithmetic, such as
    GPT-2's key bias (softmax ignores a constant added to every score of a query): the default 1e-8 turns such noise
    into lr-sized steps of random sign. Every real gradient here (>= 1e-4) is still normalised as usual."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    losses, grads = [], {}
    for step in range(steps):
        loss = loss_of(model, step, rank, world_size)
        loss.backward()
        if step == 0:
            grads = {k: _full(p.grad) for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return {"losses": losses, "grads": grads, "params": {k: _full(p) for k, p in model.named_parameters()}}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def hf_reference(name: str, seqs: tuple[int, ...]) -> dict:
    """The unsharded model trained in one process on the whole global batch of every step."""
    model, _ = hf_model(name)
    return train_steps(model, len(seqs), lambda m, s, r, w: hf_loss(m, s, seqs[s], r, w))


def branchy_reference(steps: int) -> dict:
    return train_steps(BranchyNet(), steps, branchy_loss)


# --- per-rank jobs ---------------------------------------------------------------------------------------------


def _fresh() -> None:
    torch._dynamo.reset()
    clear_compiled_graphs()


def _symbolic(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes whose value has a symbolic size, with that shape."""
    return [
        f"{n.name}: {tuple(n.meta['val'].shape)}"
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and any(isinstance(d, torch.SymInt) for d in n.meta["val"].shape)
    ]


def _graphs() -> list[dict]:
    """What the tests read from every compiled graph (picklable)."""
    return [
        {
            "kind": r.kind,
            "compile_id": r.compile_id,
            "symbolic": _symbolic(r.gm),
            "collectives": [(c.kind, c.params) for c in collectives(r.gm)],
        }
        for r in compiled_graphs()
    ]


def hf_training(rank: int, world_size: int, name: str, seqs: tuple[int, ...]) -> dict:
    """FSDP2's pattern on an unmodified `transformers` model: shard each decoder layer, then shard_compile the root."""
    _fresh()
    model, layers = hf_model(name)
    for layer in layers:
        fc.shard(layer)
    fc.shard_compile(model)
    tied = model.get_output_embeddings()._parameters["weight"] is model.get_input_embeddings()._parameters["weight"]
    result = train_steps(model, len(seqs), lambda m, s, r, w: hf_loss(m, s, seqs[s], r, w), rank, world_size)
    return result | {"tied_after_shard": tied, "counts": compile_counts(), "graphs": _graphs()}


def branchy_training(rank: int, world_size: int, steps: int) -> dict:
    _fresh()
    model = fc.shard_compile(BranchyNet())
    return train_steps(model, steps, branchy_loss, rank, world_size) | {"counts": compile_counts(), "graphs": _graphs()}


def training_jobs(rank: int, world_size: int, jobs: dict[str, tuple]) -> dict[str, dict | str]:
    """Run each job (a name -> (job function name, args) map) in this process; a job that raises gives its
    traceback instead of a result, so one broken job does not hide the others' results."""
    results: dict[str, dict | str] = {}
    for key, (fn, args) in jobs.items():
        start = time.perf_counter()
        try:
            results[key] = globals()[fn](rank, world_size, *args) | {"seconds": time.perf_counter() - start}
        except Exception:  # noqa: BLE001 - the test reports it
            results[key] = traceback.format_exc()
    return results


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None):
        out = self.fc2(torch.relu(self.fc(x)))
        return out if extra is None else (out, extra * 2)


class RankZeroExtra(nn.Module):
    """Uses `extra` on rank 0 only: the ranks would gather different parameters (and hang in FSDP2 eager)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if dist.get_rank() == 0:
            h = h + self.extra(h)
        return h


def _error(fn: Callable[[], object]) -> str:
    """`fn()`'s exception as "Type: message", or "no error"."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the tests check
        return f"{type(e).__name__}: {e}"
    return "no error"


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def bad_input(rank: int, world_size: int) -> dict[str, str]:
    """The error each kind of bad input gives (every rank runs the same calls, so none waits on another)."""
    x = torch.randn(4, 16)
    out = {}

    _fresh()
    model = fc.shard_compile(Pair())
    out["meta_input"] = _error(lambda: model(torch.randn(4, 16, device="meta")))
    out["meta_kwarg"] = _error(lambda: model(x, extra=torch.zeros(3, device="meta")))
    _step(model, x)  # and the model still works with good input
    out["good_input_after_errors"] = "ok"

    _fresh()
    model = fc.shard(Pair())
    compiled = torch.compile(model, backend="fsdp2")  # the backend's own check (no shard_compile wrapper)
    out["meta_backend"] = _error(lambda: compiled(x, torch.zeros(3, device="meta")))

    _fresh()
    model = fc.shard_compile(Pair())
    model.fc.weight = nn.Parameter(torch.zeros(8, 16))  # another shape, after shard, before compiling
    out["replaced_before_compile"] = _error(lambda: _step(model, x))

    _fresh()
    model = fc.shard_compile(Pair())
    _step(model, x)  # compiled and run once
    model.fc2.weight = nn.Parameter(torch.zeros(8, 16))
    out["replaced_after_compile"] = _error(lambda: _step(model, x))

    _fresh()
    model = fc.shard(Pair())  # eager sharded module
    model.fc.weight = nn.Parameter(torch.zeros(8, 16))
    out["replaced_eager"] = _error(lambda: _step(model, x))

    _fresh()
    model = fc.shard_compile(RankZeroExtra())
    out["rank_zero_only"] = _error(lambda: _step(model, x))
    return out
