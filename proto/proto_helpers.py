def _no_meta(key):
    return False


def input_guards_only(entries):
    import torch
    keep = [
        e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
        or (e.guard_type == "TENSOR_MATCH" and not e.is_global and not e.name.startswith("self"))
        for e in entries
    ]
    import os
    if os.environ.get("PROTO_DEBUG"):
        for e, k in zip(entries, keep):
            if k: print("KEEP", e.guard_type, e.name, type(e.value).__name__, flush=True)
    return keep


def find_paths(root, pred, max_depth=14, limit=5):
    import types
    seen, out = set(), []
    todo = [(root, "state", 0)]
    while todo and len(out) < limit:
        obj, path, d = todo.pop()
        if id(obj) in seen or d > max_depth:
            continue
        seen.add(id(obj))
        if pred(obj):
            out.append(path)
            continue
        kids = []
        if isinstance(obj, dict):
            kids = [(v, f"{path}[{k!r}]") for k, v in obj.items()] + [(k, f"{path}.key({k!r})") for k in obj]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            kids = [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif isinstance(obj, (str, bytes, int, float, type(None), types.ModuleType, type)):
            kids = []
        else:
            if hasattr(obj, "__dict__") and not isinstance(obj, type):
                kids += [(v, f"{path}.{k}") for k, v in vars(obj).items()]
            for s in getattr(type(obj), "__slots__", ()) or ():
                if hasattr(obj, s):
                    kids.append((getattr(obj, s), f"{path}.{s}"))
            if hasattr(obj, "__self__") and not isinstance(obj, types.BuiltinFunctionType):
                kids.append((obj.__self__, f"{path}.__self__"))
            if callable(obj) and hasattr(obj, "__wrapped__"):
                kids.append((obj.__wrapped__, f"{path}.__wrapped__"))
        todo += [(o, p, d + 1) for o, p in kids]
    return out
