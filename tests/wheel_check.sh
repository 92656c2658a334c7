#!/usr/bin/env bash
# The installed wheel, used as a user would, from outside the source tree: `make wheel-check` builds it, installs it
# into a fresh venv VENV that already holds torch TORCH, then runs this. Checks that that torch is still in place,
# that fsdp2_compile is imported from the venv, the README's Use example on 2 ranks, torch.compile(backend="fsdp2")
# reached through the entry point alone, and `fsdp2-compile dump`.
set -euo pipefail
VENV="$(cd "$1" && pwd)"
TORCH="$2"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
export PATH="$VENV/bin:$PATH" PYTHONPATH= OMP_NUM_THREADS=1

python - "$TORCH" "$VENV" <<'EOF'
import sys, torch, fsdp2_compile
assert torch.__version__.startswith(sys.argv[1]), f"torch {torch.__version__} replaced torch {sys.argv[1]}"
assert fsdp2_compile.__file__.startswith(sys.argv[2]), f"fsdp2_compile imported from {fsdp2_compile.__file__}"
print(f"torch {torch.__version__} kept; fsdp2_compile from {fsdp2_compile.__file__}")
EOF

# the README's Use example, as written
python - "$ROOT/README.md" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"```python torchrun=2\n(# use\.py.*?)```", text, re.S)
open("use.py", "w").write(block[1])
EOF
torchrun --nproc-per-node 2 use.py | tail -2

# the backend by name: no import of fsdp2_compile registers it
cat > backend.py <<'EOF'
import torch, torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
assert "fsdp2" in torch.compiler.list_backends(), torch.compiler.list_backends()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
ref = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
ref.load_state_dict(model.state_dict())
import fsdp2_compile  # noqa: E402  (for shard only)

fsdp2_compile.shard(model)
compiled = torch.compile(model, backend="fsdp2")
x = torch.randn(3, 4)
torch.testing.assert_close(compiled(x), ref(x))
print("backend by name: outputs match")
dist.destroy_process_group()
EOF
torchrun --nproc-per-node 2 backend.py | tail -1

cp "$ROOT/examples/llama.py" llama.py
fsdp2-compile dump llama.py:llama_tiny --world-size 4 --out dump -q > dump.log
test -s dump/summary.txt && test -s dump/trace.json
echo "fsdp2-compile dump wrote: $(ls dump | tr '\n' ' ')"
echo "wheel check passed"
